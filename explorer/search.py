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

import contextlib
import queue
import threading
import time
from typing import Any
from collections.abc import Callable, Iterator

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hseed
from hypothesis.control import current_build_context
from hypothesis.internal.conjecture import engine as hypothesis_engine

from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome

from zerostate.explorer.generate import Abort, import_what_hypothesis_peeks_at, seed_of


class _HasKey(Exception):
    """The probe met the key: for Hypothesis, a failing example to shrink."""


_ENDED = object()
"""Put on the request queue when the search thread ends."""


_DEADLINE_LIFTED = [0, 0]
"""Searches running with the limit lifted, and the limit they found (searches run in several threads at once)."""
_DEADLINE_LOCK = threading.Lock()


@contextlib.contextmanager
def no_shrink_deadline() -> Iterator[None]:
    """Hypothesis stops shrinking once it has shrunk for ``MAX_SHRINKING_SECONDS`` (300) of wall clock, so on
    a slow or loaded machine a search would end on a less shrunk scenario than on a fast one: the findings
    would depend on the machine's speed.  The exploration bounds shrinking by its hard cap on distinct runs
    instead, so the limit is lifted while any search runs (Hypothesis keeps it a module global to be patched;
    searches ahead of the in-order pass run beside it, so the last one out puts it back)."""
    if not hasattr(hypothesis_engine, "MAX_SHRINKING_SECONDS"):  # a Hypothesis without the limit
        yield
        return
    with _DEADLINE_LOCK:
        if _DEADLINE_LIFTED[0] == 0:
            _DEADLINE_LIFTED[1] = hypothesis_engine.MAX_SHRINKING_SECONDS
            hypothesis_engine.MAX_SHRINKING_SECONDS = 10 ** 9
        _DEADLINE_LIFTED[0] += 1
    try:
        yield
    finally:
        with _DEADLINE_LOCK:
            _DEADLINE_LIFTED[0] -= 1
            if _DEADLINE_LIFTED[0] == 0:
                hypothesis_engine.MAX_SHRINKING_SECONDS = _DEADLINE_LIFTED[1]


class ShrinkSearch:
    """One search for ``want`` over ``strategy``'s sequence of ``seed``, ``examples`` examples long."""

    def __init__(self, strategy: Any, examples: int, seed: int | None, want: str,
                 known: Callable[[Scenario], Outcome | None]):
        self.strategy = strategy
        self.known = known
        """The outcome of a scenario run already (memoised), read here without a round trip (a dict read: the
        pass's thread may add to it meanwhile when this search runs ahead, `ahead`)."""
        self.examples = examples
        self.seed = seed
        self.want = want
        self.found: Scenario | None = None
        """The smallest scenario with the key Hypothesis ended on (None: the sequence never showed it)."""
        self.cpu_seconds = 0.0
        """The CPU time the search's own thread took (Hypothesis drawing and shrinking), once it ended."""
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
        t0 = time.thread_time()
        try:
            self._search_in_thread()
        finally:
            self.cpu_seconds = time.thread_time() - t0

    def _search_in_thread(self) -> None:
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
            with no_shrink_deadline():
                hseed(seed_of(self.seed))(probe)()
        except _HasKey:
            self.found = final[-1] if final else None
        except Abort:
            pass
        except BaseException as exc:  # noqa: BLE001 -- raised by `requests`, in the exploration's thread
            self._error = exc
        finally:
            self._requests.put(_ENDED)


__all__ = ["ShrinkSearch", "no_shrink_deadline"]
