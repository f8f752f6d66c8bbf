"""The pairwise completion's first round, drawn while the generated lanes still run (`FirstRound`).

The first round reads no outcome -- it completes the pairs no generated scenario takes (`pairs.completing`) --, so it
can be drawn as soon as the generated sequence is known.  With helper processes to draw in (`draw_pool`), the round is
drawn in a thread from then on (explore makes it when the generated stream ends) and its lanes go to the first worker
that has no generated lane left, as their examples are chosen: with more workers than generated lanes (the default
200 are two), at once.  The helpers draw at
a lower priority (`draw_pool.NICE`), so they take the CPU the workers leave.  The examples, their order and their
positions are those drawn in one piece afterwards: only when they run changes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence

from zerostate.model.scenario import Scenario

from zerostate.explorer.pairs import Completion, Drawer, Pair, completing, draws

_DONE = object()


class _Cancelled(Exception):
    """The exploration no longer wants the round (it stopped, or it ended first)."""


class FirstRound:
    """Round 1 of the completion of ``ran``, at most ``budget`` examples, into ``out`` (its examples, the pairs
    found not drawable, ``left`` once done).  With a ``drawer`` it is drawn in a thread from now on; without one,
    here, as `examples` is iterated.  ``out.draw_seconds`` adds the seconds spent in the forced draws."""

    def __init__(self, out: Completion, ran: Iterable[Scenario], budget: int, seed: int | None,
                 drawer: Drawer | None = None):
        self.out = out
        self._drawer: Drawer = drawer or (lambda pair, _next: draws(pair, seed))
        self._cancel = threading.Event()
        self._examples: Generator[Scenario, None, None] = completing(out, ran, budget, seed, drawer=self._timed)
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread: threading.Thread | None = None
        if drawer is not None:
            self._thread = threading.Thread(target=self._draw, daemon=True, name="explore-completion")
            self._thread.start()

    def _timed(self, pair: Pair, nxt: Sequence[Pair]) -> tuple[Scenario, ...] | None:
        if self._cancel.is_set():
            raise _Cancelled()
        t0 = time.perf_counter()
        try:
            return self._drawer(pair, nxt)
        finally:
            self.out.draw_seconds += time.perf_counter() - t0

    def _draw(self) -> None:
        try:
            for sc in self._examples:
                self._queue.put(sc)
        except _Cancelled:
            pass
        except BaseException as exc:  # noqa: BLE001 -- raised in the lane that asks for the next example
            self._queue.put(exc)
        finally:
            self._queue.put(_DONE)

    def examples(self, stop: threading.Event) -> Iterator[Scenario]:
        """The round's examples in order, each as soon as it is chosen; ends early when ``stop`` is set."""
        if self._thread is None:
            yield from self._examples
            return
        while not stop.is_set():
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is _DONE:
                self._queue.put(_DONE)  # asked again, it is still over
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, Scenario)
            yield item

    def close(self) -> None:
        """Stop drawing (at the next pair) and wait for the thread: the drawer is the caller's again."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join()
        else:
            self._examples.close()

    def __enter__(self) -> FirstRound:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["FirstRound"]
