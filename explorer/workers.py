"""The workers an exploration runs on, and the generated lanes run on them.

A worker is a `Target`: ``fresh()`` starts it afresh, nothing carried over, where it can be (``can_refresh``: the
deepspeed target; the model target, a pure function, cannot and need not), ``restarts`` counts how often a hang, a
crash or ranks out of step forced a restart and ``examples`` its runs so far.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from collections.abc import Callable, Generator, Iterator

from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Target


def has_run(w: Target) -> bool:
    """Whether the worker ran examples already (then a lane starts it afresh first)."""
    return w.examples > 0


def refresh(w: Target) -> bool:
    """Start ``w`` afresh when it can be (`Target.can_refresh`); whether it was."""
    if not w.can_refresh:
        return False
    w.fresh()
    return True


def close_quietly(w: Target) -> None:
    """Close a worker the exploration made; one that fails to close is already gone."""
    try:
        w.close()
    except Exception:  # noqa: BLE001 -- a worker that cannot close has nothing left to lose
        return


def spawn_workers(count: int, spawn: Callable[[], Target]) -> list[Target]:
    """``count`` more workers, started at once (each start takes seconds); all or none."""
    made: list[Target | None] = [None] * count
    errors: list[BaseException] = []

    def make(i: int) -> None:
        try:
            made[i] = spawn()
        except BaseException as exc:  # noqa: BLE001 -- re-raised below, in the caller's thread
            errors.append(exc)
    threads = [threading.Thread(target=make, args=(i,), daemon=True) for i in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    workers = [m for m in made if m is not None]
    if errors:
        for m in workers:
            close_quietly(m)
        raise errors[0]
    return workers


@dataclass(frozen=True)
class LaneStep:
    """One step of a lane on worker ``worker``: a fresh start (``scenario`` None) or one distinct run."""

    worker: int
    scenario: Scenario | None
    outcome: Outcome | None
    restarts: int
    """The worker's restart count after it."""
    error: BaseException | None = None
    """The target broke (it could not run or restart): the exploration stops with this error."""


def run_lanes(workers: list[Target], lanes: Iterator[list[Scenario]], stop: threading.Event,
              fresh_first: list[bool]) -> Generator[LaneStep, None, None]:
    """Run ``lanes`` on ``workers``: each lane in order, in a worker started fresh for it (``fresh_first[w]``:
    also its first lane); yields the steps in the order they end.  One worker: inline, in the caller's
    thread (a Ctrl-C lands in its run); several: one thread per worker."""
    if len(workers) == 1:
        return _inline(workers[0], lanes, stop, fresh_first)
    return _threaded(workers, lanes, stop, fresh_first)


def _start_lane(workers: list[Target], wid: int, fresh_first: list[bool]) -> None:
    if fresh_first[wid]:
        refresh(workers[wid])
    fresh_first[wid] = True


def _inline(w: Target, lanes: Iterator[list[Scenario]], stop: threading.Event,
            fresh_first: list[bool]) -> Generator[LaneStep, None, None]:
    for lane in lanes:
        if stop.is_set():
            return
        _start_lane([w], 0, fresh_first)
        yield LaneStep(0, None, None, w.restarts)
        for sc in lane:
            if stop.is_set():
                return
            try:
                out = w.run(sc)
            except Exception as exc:  # noqa: BLE001 -- the caller stops with it
                yield LaneStep(0, sc, None, 0, exc)
                return
            yield LaneStep(0, sc, out, w.restarts)


def _threaded(workers: list[Target], lanes: Iterator[list[Scenario]], stop: threading.Event,
              fresh_first: list[bool]) -> Generator[LaneStep, None, None]:
    take = threading.Lock()
    results: queue.Queue[LaneStep | int] = queue.Queue()

    def work(wid: int) -> None:
        try:
            while not stop.is_set():
                with take:  # lanes are handed out in order
                    lane = next(lanes, None)
                if lane is None:
                    return
                _run_lane(workers, wid, lane, stop, fresh_first, results)
        except Exception as exc:  # noqa: BLE001 -- the caller stops with it
            results.put(LaneStep(wid, None, None, 0, exc))
        finally:
            results.put(wid)  # this worker is done

    threads = [threading.Thread(target=work, args=(w,), daemon=True, name=f"explore-job-{w}")
               for w in range(len(workers))]
    for t in threads:
        t.start()
    live = len(threads)
    try:
        while live:
            try:
                item = results.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(item, int):
                live -= 1
                continue
            yield item
    finally:
        stop.set()
        for t in threads:
            t.join()


def _run_lane(workers: list[Target], wid: int, lane: list[Scenario], stop: threading.Event,
              fresh_first: list[bool], results: queue.Queue[LaneStep | int]) -> None:
    """One lane on worker ``wid`` (in its thread); a target error ends the lane and is raised to `work`."""
    _start_lane(workers, wid, fresh_first)
    results.put(LaneStep(wid, None, None, workers[wid].restarts))
    for sc in lane:
        if stop.is_set():
            return
        out = workers[wid].run(sc)
        results.put(LaneStep(wid, sc, out, workers[wid].restarts))


__all__ = ["LaneStep", "close_quietly", "has_run", "refresh", "run_lanes", "spawn_workers"]
