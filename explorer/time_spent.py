"""Where an exploration's time went: its phases' wall clock beside what its workers spent (`Spent`: runs, their
CPU, the oracle's share, the judgement, the worker starts), and the limit the runs set.

The limit: the runs' own CPU time divided by the cores -- the wall clock an exploration could reach if nothing
but the runs cost anything (no process start, no waiting).  ``wall_over_limit`` is how far from it this one was.
"""

from __future__ import annotations

import os
from typing import Any

from zerostate.targets.interface import Spent, Target

PHASES = ("generation", "shrinking", "confirmation")
"""``generation``: the generated lanes and the pairwise completion; ``shrinking``: each finding's search and
polish; ``confirmation``: waiting, after shrinking, for the replays that confirm findings (those that landed
earlier ran beside the other phases)."""


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def spent_by(workers: list[Target]) -> Spent | None:
    """What ``workers`` spent together; None when one of them does not measure it (the model target, a cluster's
    remote workers): a sum over some workers only would read as the whole."""
    parts = [w.spent() for w in workers]
    measured = [s for s in parts if s is not None]
    if not parts or len(measured) < len(parts):
        return None
    return sum(measured, Spent())


def breakdown(wall: float, phases: dict[str, float], spent: Spent | None, n_cores: int,
              completion: tuple[float, float] | None = None,
              explorer: tuple[float, float] | None = None) -> dict[str, Any]:
    """The report's ``time``: ``wall``, ``phases`` (seconds each), what the workers ``spent`` (`Spent.to_dict`,
    or null: not measured), ``cores``, ``cpu_limit`` (the runs' CPU seconds / cores) and ``wall_over_limit``;
    with the pairwise ``completion``'s (draw seconds, seconds a worker waited for its draws), ``completion``
    (part of the generation phase: drawn beside the generated lanes, what was waited for is its cost); with
    ``explorer`` (this process's CPU seconds, its Hypothesis searches' share), ``explorer_cpu``: the exploring
    process is one interpreter, so its own CPU is a floor of its own (one core at most) beside the runs'."""
    out: dict[str, Any] = {"wall": round(wall, 2), "phases": {p: round(phases.get(p, 0.0), 2) for p in PHASES},
                           "spent": spent.to_dict() if spent is not None else None, "cores": n_cores}
    if completion is not None:
        out["completion"] = {"draw_seconds": round(completion[0], 2), "waited_seconds": round(completion[1], 2)}
    if explorer is not None:
        out["explorer_cpu"] = {"seconds": round(explorer[0], 2), "searches": round(explorer[1], 2)}
    if spent is not None and spent.cpu_seconds > 0:
        limit = spent.cpu_seconds / n_cores
        out["cpu_limit"] = round(limit, 2)
        out["wall_over_limit"] = round(wall / limit, 2)
    return out


def time_line(t: dict[str, Any]) -> str:
    """One line for the summary: the wall clock, where it went, and the limit."""
    ph = t["phases"]
    c = t.get("completion")
    drawn = (f", of it {c['waited_seconds']:.0f} s waiting for the pairwise completion's draws "
             f"({c['draw_seconds']:.0f} s drawn in all)") if c else ""
    head = (f"time: {t['wall']:.0f} s wall (generation {ph['generation']:.0f} s{drawn}, shrinking "
            f"{ph['shrinking']:.0f} s, waiting for confirmations {ph['confirmation']:.0f} s)")
    s = t.get("spent")
    if s is None:
        return head + ("; the runs and starts are not measured (a target without worker processes, or workers "
                       "that do not report them)")
    runs = (f"; {s['runs']} run(s): {s['run_seconds']:.0f} s, of it {s['worker_seconds']:.0f} s in the workers "
            f"({s['cpu_seconds']:.0f} CPU-s, of it the oracle's {s['oracle_seconds']:.0f}) and "
            f"{s['judge_seconds']:.0f} s judging")
    forked = s.get("forked_starts", 0)
    how = f" ({forked} forked from a fork server)" if forked else " (none forked: each a new process)"
    starts = (f"; {s['starts']} worker start(s){how}: {s['start_waited']:.0f} s waited, {s['start_seconds']:.0f} s "
              "their own start-up")
    e = t.get("explorer_cpu")
    own = (f"; the explorer's own CPU {e['seconds']:.0f} s (of it its Hypothesis searches' {e['searches']:.0f})"
           if e else "")
    limit = (f"; the runs' CPU / {t['cores']} core(s) = {t['cpu_limit']:.0f} s, wall {t['wall_over_limit']:.1f}x that"
             if "cpu_limit" in t else "")
    return head + runs + starts + own + limit


__all__ = ["PHASES", "breakdown", "cores", "spent_by", "time_line"]
