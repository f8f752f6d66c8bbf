"""Confirm a finding before it is reported: replay it in a fresh worker, alone, then after its history.

A finding is only worth a reviewer's time if its replay command reproduces it.  The
explorer runs every example in one persistent worker (a rank pool at world size 2), so an example can
inherit state from the examples before it.  `confirm` judges a finding (by its key, `Finding.key`):

* ``confirmed``        -- its scenario, run alone in a fresh worker, has the finding's key;
* ``order-dependent``  -- it does not alone, but it does after the examples that ran before it in the
  same worker (its *history*, from the worker's start); the shortest run of them that still makes it
  appear is found (the shortest suffix of the history, by bisection; then its first example alone, else
  chunks of the rest dropped while it still appears) and becomes ``sequence``: the replay command and the repro
  script run it first;
* ``intermittent``     -- neither alone nor after its whole history, but in some of ``REPEAT`` runs of
  the scenario alone in one fresh worker (fewer when they take over ``REPEAT_SECONDS``) (a race: DeepSpeed
  0.19.2's ZeRO-3 at world size 2 on gloo, persistent parameters and a fused head, about 2-5 % of runs;
  docs/world-size-2.md): ``hits`` of
  ``repeat`` runs; the replay runs the scenario up to ``repeat`` times (``zerostate replay --repeat``);
* ``not-reproduced``   -- none of these: reported all the same, marked so;
* ``not-checked``      -- the run was interrupted before it could be replayed.

A target that has no ``fresh()`` (the model target: a pure function) is confirmed by running the
scenario once more.  Each try costs a fresh worker (seconds; a rank pool's start-up at world size 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
import queue
import threading
from typing import Any, Generic, TypeVar
from collections.abc import Iterator

from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Target

from zerostate.explorer.workers import refresh

REPEAT = 100
"""Runs of the scenario alone, in one fresh worker, before a finding is called not reproduced."""

MAX_TRIES = 16
"""Fresh workers one confirmation may start at most (the alone run and the whole history included)."""

STATUSES = ("confirmed", "order-dependent", "intermittent", "not-reproduced", "not-checked")


@dataclass
class Confirmation:
    status: str
    sequence: list[Scenario] = field(default_factory=list)
    """``order-dependent``: the examples to run first, in order, in a fresh worker."""
    tries: int = 0
    seconds: float = 0.0
    history: int = 0
    """How many examples had run in the worker before the finding's own run."""
    last_run: list[Scenario] = field(default_factory=list)
    """What the worker has run since its last fresh start (the explorer's history goes on from there)."""
    repeat: int = 0
    """``intermittent``: runs of the scenario alone in one fresh worker ..."""
    hits: int = 0
    """... and how many of them had the finding."""

    def to_dict(self) -> dict[str, Any]:
        d = {"status": self.status, "sequence_length": len(self.sequence), "tries": self.tries,
             "seconds": round(self.seconds, 2), "history": self.history}
        if self.repeat:
            d.update(repeat=self.repeat, hits=self.hits)
        return d


def reproduces(target: Target, key: str, scenario: Scenario, before: list[Scenario]) -> bool:
    """Does ``scenario`` have a finding with ``key`` when run in a fresh worker after ``before``?"""
    refresh(target)
    for sc in before:
        target.run(sc)
    return any(f.key == key for f in target.run(scenario).findings)


REPEAT_SECONDS = 180.0
"""...and at most this long (a hang costs its timeout per run): fewer runs are made, and said."""


def hits_alone(target: Target, key: str, scenario: Scenario, repeat: int,
               max_seconds: float | None = None) -> tuple[int, int]:
    """``(hits, runs)``: in how many of ``runs`` runs of ``scenario``, one after another in one fresh worker,
    it has ``key``; ``runs`` is ``repeat``, or fewer when ``max_seconds`` ran out first."""
    refresh(target)
    t0, hits, runs = time.perf_counter(), 0, 0
    while runs < repeat and (max_seconds is None or runs == 0 or time.perf_counter() - t0 < max_seconds):
        hits += any(f.key == key for f in target.run(scenario).findings)
        runs += 1
    return hits, runs


def confirm(target: Target, key: str, scenario: Scenario, history: list[Scenario],
            max_tries: int = MAX_TRIES, repeat: int = REPEAT) -> Confirmation:
    t0 = time.perf_counter()
    tries = [0]
    last: list[list[Scenario]] = [[]]

    def attempt(before: list[Scenario]) -> bool:
        tries[0] += 1
        last[0] = list(before) + [scenario]
        return reproduces(target, key, scenario, before)

    def done(status: str, seq: list[Scenario] | None = None) -> Confirmation:
        return Confirmation(status, list(seq or []), tries[0], time.perf_counter() - t0, len(history), last[0])

    if attempt([]):
        return done("confirmed")
    if not target.can_refresh:
        return done("not-reproduced")
    if not history or not attempt(history):
        tries[0] += 1
        hits, runs = hits_alone(target, key, scenario, repeat, REPEAT_SECONDS)
        last[0] = [scenario] * runs
        c = done("intermittent" if hits else "not-reproduced")
        c.repeat, c.hits = runs, hits
        return c
    lo, hi = 1, len(history)  # the whole history reproduces it: the shortest suffix that still does
    while lo < hi and tries[0] < max_tries:
        mid = (lo + hi) // 2
        if attempt(history[-mid:]):
            hi = mid
        else:
            lo = mid + 1
    seq = list(history[-hi:])
    # the shortest suffix's first example is needed (without it the suffix is too short): try it alone,
    # then drop chunks of the rest while the finding still appears (ddmin), within the tries left
    if len(seq) > 1 and tries[0] < max_tries and attempt(seq[:1]):
        seq = seq[:1]
    n = 2
    while len(seq) > 1 and tries[0] < max_tries:
        size = -(-(len(seq) - 1) // n)
        for i in range(1, len(seq), size):
            if tries[0] >= max_tries:
                break
            cand = seq[:i] + seq[i + size:]
            if attempt(cand):
                seq, n = cand, max(n - 1, 2)
                break
        else:
            if size <= 1:
                break
            n = min(len(seq) - 1, 2 * n)
    return done("order-dependent", seq)


T = TypeVar("T")


@dataclass(frozen=True)
class Job(Generic[T]):
    """A finding to confirm: ``item`` is the caller's record of it, handed back with its confirmation."""

    item: T
    key: str
    scenario: Scenario
    history: list[Scenario]


@dataclass(frozen=True)
class Landed(Generic[T]):
    item: T
    confirmation: Confirmation
    inline: bool
    """Replayed on the first worker, in the caller's thread: that worker's history goes on from
    ``confirmation.last_run``."""
    restarted: bool
    """... and the first worker was restarted meanwhile (its history starts afresh after it)."""


class ConfirmQueue(Generic[T]):
    """Findings waiting for their replay in a fresh worker.  With helper workers (``jobs`` > 1) each is
    replayed on a helper, in a thread, while the first worker shrinks the next key; without, on the first
    worker once shrinking is over, so that shrinking runs after the same examples whatever ``jobs`` is."""

    def __init__(self, first: Target):
        self.first = first
        self._jobs: queue.Queue[Job[T] | None] = queue.Queue()
        self._done: queue.Queue[tuple[Job[T], Confirmation | BaseException]] = queue.Queue()
        self._pending: list[Job[T]] = []
        self._threads: list[threading.Thread] = []
        self._outstanding = 0
        self._elsewhere = False

    def served_elsewhere(self) -> None:
        """Helpers of the caller's take the jobs (`take`, `replay`): none are replayed inline."""
        self._elsewhere = True

    def take(self) -> Job[T] | None:
        """The next job waiting, if any (for a helper of the caller's)."""
        try:
            job = self._jobs.get_nowait()
        except queue.Empty:
            return None
        return job

    def replay(self, job: Job[T], w: Target) -> Confirmation | None:
        """Replay ``job`` on the helper worker ``w`` and hand its confirmation over; None when the worker broke
        (the error is raised by `landed`, in the caller's thread)."""
        try:
            c = confirm(w, job.key, job.scenario, job.history)
        except BaseException as exc:  # noqa: BLE001 -- raised in the caller's thread
            self._done.put((job, exc))
            return None
        self._done.put((job, c))
        return c

    def add_helpers(self, helpers: list[Target]) -> None:
        for w in helpers:
            self._threads.append(threading.Thread(target=self._help, args=(w,), daemon=True,
                                                  name="explore-confirm"))
            self._threads[-1].start()

    def submit(self, job: Job[T]) -> None:
        self._outstanding += 1
        if self._threads or self._elsewhere:
            self._jobs.put(job)
        else:
            self._pending.append(job)

    def landed(self, block: bool) -> Iterator[Landed[T]]:
        """The confirmations that are done (``block``: every one, waiting for them); a helper's error (its
        worker broke) is raised here."""
        while self._outstanding:
            got = self._from_helper(block) if self._threads or self._elsewhere else self._inline() if block else None
            if got is None:
                return
            self._outstanding -= 1
            yield got

    def stop(self) -> None:
        """Tell the helpers to end after their current replay (their workers are closed by the caller)."""
        for _ in self._threads:
            self._jobs.put(None)

    def join(self) -> None:
        for th in self._threads:
            th.join(timeout=30)

    def _from_helper(self, block: bool) -> Landed[T] | None:
        while True:
            try:
                job, c = self._done.get(timeout=0.5) if block else self._done.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return None
            if isinstance(c, BaseException):
                raise c
            return Landed(job.item, c, False, False)

    def _inline(self) -> Landed[T]:
        job = self._pending.pop(0)
        before = self.first.restarts
        c = confirm(self.first, job.key, job.scenario, job.history)
        return Landed(job.item, c, True, self.first.restarts != before)

    def _help(self, w: Target) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.replay(job, w)


__all__ = ["Confirmation", "ConfirmQueue", "Job", "Landed", "MAX_TRIES", "REPEAT", "REPEAT_SECONDS", "STATUSES",
           "confirm", "hits_alone", "reproduces"]
