"""Shrink: one Hypothesis search for one finding key, with every run made by the exploration's own thread.

A search replays the generated sequence (its outcomes are memoised, so that costs nothing) up to the first
example with the key and shrinks it: the predicate "has this key" is fixed, so shrinking is sound.
Hypothesis drives the search from a thread of its own; each scenario it wants judged comes out of
`ShrinkSearch.requests` to the exploration, which runs it (on its first worker, in its own thread: a
Ctrl-C lands there, as in every other run) and hands the outcome back with `answer`.  So the exploration
stays one stream of events, and the search is stopped by `close` (the budget, a stop, Ctrl-C), never by an
exception thrown through Hypothesis from outside.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hseed
from hypothesis.control import current_build_context

from zerostate.model.scenario import Scenario
from zerostate.targets.base import Outcome

from zerostate.explorer.generate import Abort, import_what_hypothesis_peeks_at, seed_of


class _HasKey(Exception):
    """The probe met the key: for Hypothesis, a failing example to shrink."""


_ENDED = object()
"""Put on the request queue when the search thread ends."""


class ShrinkSearch:
    """One search for ``want`` over ``strategy``'s sequence of ``seed``, ``examples`` examples long."""

    def __init__(self, strategy: Any, examples: int, seed: int | None, want: str,
                 known: Callable[[Scenario], Outcome | None]):
        self.strategy = strategy
        self.known = known
        """The outcome of a scenario run already (memoised), read here without a round trip: the
        exploration's thread writes it only while this thread waits for an answer."""
        self.examples = examples
        self.seed = seed
        self.want = want
        self.found: Scenario | None = None
        """The smallest scenario with the key Hypothesis ended on (None: the sequence never showed it)."""
        self._requests: queue.Queue[Any] = queue.Queue()
        self._answers: queue.Queue[Outcome | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def requests(self) -> Iterator[Scenario]:
        """The scenarios the search wants judged, one at a time: `answer` each before the next comes."""
        import_what_hypothesis_peeks_at()
        self._thread = threading.Thread(target=self._search, daemon=True, name="explore-shrink")
        self._thread.start()
        while True:
            item = self._next_request()
            if item is _ENDED:
                break
            yield item
        if self._error is not None:
            raise self._error

    def answer(self, out: Outcome) -> None:
        self._answers.put(out)

    def close(self) -> None:
        """End the search now, if it still runs (its probe, waiting for an answer, is told to abort)."""
        if self._thread is None:
            return
        if self._thread.is_alive():
            self._answers.put(None)
            self._thread.join(timeout=30)
        self._thread = None

    def _next_request(self) -> Any:
        while True:
            try:
                return self._requests.get(timeout=0.5)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._requests.empty():
                    return _ENDED

    def _ask(self, sc: Scenario) -> Outcome:
        ran = self.known(sc)
        if ran is not None:
            return ran
        self._requests.put(sc)
        out = self._answers.get()
        if out is None:
            raise Abort()
        return out

    def _search(self) -> None:
        final: list[Scenario] = []

        @settings(max_examples=self.examples, database=None, deadline=None, derandomize=False,
                  phases=[Phase.generate, Phase.shrink], report_multiple_bugs=False, print_blob=False,
                  suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
        @given(self.strategy)
        def probe(sc: Scenario) -> None:
            out = self._ask(sc)
            if current_build_context().is_final:
                final.append(sc)
            if any(f.key == self.want for f in out.findings):
                raise _HasKey()

        try:
            hseed(seed_of(self.seed))(probe)()
        except _HasKey:
            self.found = final[-1] if final else None
        except Abort:
            pass
        except BaseException as exc:  # noqa: BLE001 -- raised by `requests`, in the exploration's thread
            self._error = exc
        finally:
            self._requests.put(_ENDED)


__all__ = ["ShrinkSearch"]
