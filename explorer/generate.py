"""Generate: the deterministic sequence of scenarios an exploration runs, drawn by Hypothesis in a thread.

`generated` is the first ``examples`` scenarios of one seeded Hypothesis sequence (duplicates included);
`Lanes` cuts its distinct scenarios into lanes of `LANE`, remembering each one's position in the sequence
("found within N examples").  Drawing runs no target: a test that never fails makes Hypothesis generate
exactly the sequence a failing search generates up to its failure, so every shrink search (`search`)
replays this sequence first.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any
from collections.abc import Generator, Iterator

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hseed

from zerostate.model.scenario import Scenario

DEFAULT_SEED = 0
"""The sequence ``seed=None`` explores.  A fixed seed rather than Hypothesis' ``derandomize``: derandomize
seeds from a digest of the test function's *source*, so every edit of this package would change which
examples are explored; a fixed seed keeps the sequence a function of the strategies alone."""

LANE = 100
"""Generated examples per lane: the generated sequence is cut into lanes of this many distinct scenarios,
each run in order in a worker started fresh for it, whatever ``jobs`` is -- so every example runs after
the same examples, and an example whose outcome depends on what ran before it in the worker (state
carried over) has the same outcome with one job or eight.  Each lane costs a worker start (a few
seconds; a rank pool's at world size 2), so lanes are long: the default budget
(`cli.cmd_explore.DEFAULT_EXAMPLES`) is two."""


def seed_of(seed: int | None) -> int:
    return DEFAULT_SEED if seed is None else seed


class Abort(BaseException):
    """Ends a thread that runs Hypothesis (a BaseException: Hypothesis re-raises it at once)."""


def import_what_hypothesis_peeks_at() -> None:
    """Import numpy (when installed) before drawing starts in a thread of its own.  While it draws, Hypothesis
    looks numpy up in ``sys.modules`` (``sampled_from`` checks for ``numpy.ndarray``); if the main thread is
    importing numpy at that moment (a target may import torch, which imports numpy), the drawing thread finds
    it half-initialised, fails with "partially initialized module 'numpy' has no attribute 'ndarray'", and
    the run ends with that error (seen under load in the Ctrl-C CI test).  Imported once here, it is whole
    before the drawing thread starts."""
    import importlib.util
    if "numpy" not in sys.modules and importlib.util.find_spec("numpy") is not None:
        import numpy  # noqa: F401


def generated(strategy: Any, examples: int, seed: int | None) -> Generator[Scenario, None, None]:
    """The first ``examples`` scenarios of the deterministic generation sequence of ``seed`` (duplicates
    included, in order): what every search of `exploration` replays.  Drawing runs no target: a test that never
    fails makes Hypothesis generate exactly the sequence a failing search generates up to its failure.
    Drawn in a thread, a little ahead of the consumer (so ``examples`` may be huge); closing the iterator
    ends the drawing."""
    import_what_hypothesis_peeks_at()
    q: queue.Queue[Any] = queue.Queue(maxsize=2 * LANE)
    halt = threading.Event()
    done = object()

    def put(item: Any) -> None:
        while not halt.is_set():
            try:
                q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise Abort()

    @settings(max_examples=examples, database=None, deadline=None, derandomize=False, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @given(strategy)
    def draw(sc: Scenario) -> None:
        put(sc)

    def produce() -> None:
        try:
            hseed(seed_of(seed))(draw)()
            put(done)
        except Abort:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            try:
                put(exc)
            except Abort:
                pass

    th = threading.Thread(target=produce, daemon=True, name="explore-draw")
    th.start()
    try:
        while True:
            try:
                item = q.get(timeout=0.5)
            except queue.Empty:
                if not th.is_alive():
                    return
                continue
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        halt.set()
        th.join(timeout=10)


class Lanes:
    """The distinct scenarios of a generated sequence, in lanes of ``size``, and where each first appeared."""

    def __init__(self, stream: Iterator[Scenario], size: int):
        self.stream = stream
        self.size = size
        self.position: dict[Scenario, int] = {}
        """Scenario -> its first position in the generated sequence, from 1."""

    def __iter__(self) -> Iterator[list[Scenario]]:
        batch: list[Scenario] = []
        for i, sc in enumerate(self.stream, 1):
            if sc in self.position:
                continue
            self.position[sc] = i
            batch.append(sc)
            if len(batch) == self.size:
                yield batch
                batch = []
        if batch:
            yield batch


__all__ = ["Abort", "DEFAULT_SEED", "LANE", "Lanes", "generated", "import_what_hypothesis_peeks_at", "seed_of"]
