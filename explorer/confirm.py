"""Confirm a finding before it is reported: replay it in a fresh worker, alone, then after its history.

A finding is only worth a reviewer's time if its replay command reproduces it (issue 15).  The
explorer runs every example in one persistent worker (a rank pool at world size 2), so an example can
inherit state from the examples before it.  `confirm` judges a finding (by its key, `Finding.key`):

* ``confirmed``        -- its scenario, run alone in a fresh worker, has the finding's key;
* ``order-dependent``  -- it does not alone, but it does after the examples that ran before it in the
  same worker (its *history*, from the worker's start); the shortest run of them that still makes it
  appear is found (the shortest suffix of the history, by bisection; then its first example alone, else
  chunks of the rest dropped while it still appears) and becomes ``sequence``: the replay command and the repro script run it first;
* ``intermittent``     -- neither alone nor after its whole history, but in some of ``REPEAT`` runs of
  the scenario alone in one fresh worker (fewer when they take over ``REPEAT_SECONDS``) (a race: DeepSpeed 0.19.2's ZeRO-3 at world size 2 on gloo,
  persistent parameters and a fused head, about 2-5 % of runs; docs/world-size-2.md): ``hits`` of
  ``repeat`` runs; the replay runs the scenario up to ``repeat`` times (``zerostate replay --repeat``);
* ``not-reproduced``   -- none of these: reported all the same, marked so;
* ``not-checked``      -- the run was interrupted before it could be replayed.

A target that has no ``fresh()`` (the model target: a pure function) is confirmed by running the
scenario once more.  Each try costs a fresh worker (seconds; a rank pool's start-up at world size 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from zerostate.model.scenario import Scenario

REPEAT = 100
"""Runs of the scenario alone, in one fresh worker, before a finding is called not reproduced."""

MAX_TRIES = 16
"""Fresh workers one confirmation may start at most (the alone run and the whole history included)."""

STATUSES = ("confirmed", "order-dependent", "intermittent", "not-reproduced", "not-checked")


class StopExploring(KeyboardInterrupt):
    """Raised by the explorer's ``on_progress`` callback to end a run early (a time budget): the findings
    seen so far are handed over *confirmed*, then it propagates (a plain Ctrl-C skips the confirmation)."""


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


def reproduces(target: Any, key: str, scenario: Scenario, before: list[Scenario]) -> bool:
    """Does ``scenario`` have a finding with ``key`` when run in a fresh worker after ``before``?"""
    fresh = getattr(target, "fresh", None)
    if fresh is not None:
        fresh()
    for sc in before:
        target.run(sc)
    return any(f.key == key for f in target.run(scenario).findings)


REPEAT_SECONDS = 180.0
"""...and at most this long (a hang costs its timeout per run): fewer runs are made, and said."""


def hits_alone(target: Any, key: str, scenario: Scenario, repeat: int,
               max_seconds: float | None = None) -> tuple[int, int]:
    """``(hits, runs)``: in how many of ``runs`` runs of ``scenario``, one after another in one fresh worker,
    it has ``key``; ``runs`` is ``repeat``, or fewer when ``max_seconds`` ran out first."""
    fresh = getattr(target, "fresh", None)
    if fresh is not None:
        fresh()
    t0, hits, runs = time.perf_counter(), 0, 0
    while runs < repeat and (max_seconds is None or runs == 0 or time.perf_counter() - t0 < max_seconds):
        hits += any(f.key == key for f in target.run(scenario).findings)
        runs += 1
    return hits, runs


def confirm(target: Any, key: str, scenario: Scenario, history: list[Scenario],
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
    if getattr(target, "fresh", None) is None:
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


__all__ = ["Confirmation", "REPEAT", "StopExploring", "hits_alone", "MAX_TRIES", "STATUSES", "confirm", "reproduces"]
