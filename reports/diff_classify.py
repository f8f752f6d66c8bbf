"""What ``zerostate diff`` says of each finding: fixed, not reached, introduced, unmasked, unchanged, intermittent.

Every finding is replayed on the other build (`replay`): first once (the other exploration's run of the
scenario, when it made one), then -- when that run does not show it -- with confirm.py's bar for "not
reproduced": its order-dependent ``sequence`` first, in a fresh worker, then `confirm.REPEAT` runs of the
scenario alone in one fresh worker (fewer when they take over `confirm.REPEAT_SECONDS`).  A base finding is
**fixed** only when none of those runs shows it on head -- exactly when the explorer would call it not
reproduced there -- and head's run went past the train step where base failed (`reached`); a head that
stopped earlier or broke the tracer has not judged it: **not-reached**.  A race can show in a few runs in a
hundred, so even that many runs can all miss it (the odds for the race the project knows: docs/world-size-2.md,
"What a diff's replays can miss"); the entry says how many runs were made, so a reader can weigh it.  A finding
that shows in some of those runs but not in the first is **intermittent** on the other build: neither fixed nor
unchanged.

The same finding on two builds is `same_bug`: the same fingerprint (`Finding.key`: the finding's own evidence),
never only the same label.  So a head finding whose scenario fails on base under the same known issue but by
another mechanism (a patch swapping one crash for another) is **introduced**, not unchanged and not unmasked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol
from collections.abc import Callable, Sequence

from zerostate.explorer.confirm import REPEAT, REPEAT_SECONDS
from zerostate.findings.finding import Finding
from zerostate.findings.harness import harness_error
from zerostate.model.events import EventKind
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome

from zerostate.reports.diff_model import DiffEntry, OtherBuildReplay, ReplayedFinding
from zerostate.reports.finding_entry import Labels

STATUSES = ("introduced", "fixed", "not-reached", "intermittent", "unmasked", "unchanged")
"""In the order a diff lists them."""


class Build(Protocol):
    """One side of a diff (`cmd_diff.Recorder`): its release, memoised runs, and fresh repeated ones."""

    version: str | None

    def run(self, sc: Scenario) -> Outcome: ...

    def repeat(self, sc: Scenario, shows: Callable[[Outcome], bool], before: Sequence[Scenario], runs: int,
               max_seconds: float) -> tuple[int, int]: ...


def mechanism(f: Finding) -> tuple[str, ...]:
    """What went wrong, as the finding's own run shows it: its fingerprint (`Finding.key`)."""
    return (f.key,)


def same_bug(a: Finding, b: Finding) -> bool:
    """Two findings (one per build) are one bug when their mechanisms are equal: a shared label is not enough."""
    return mechanism(a) == mechanism(b)


@dataclass(frozen=True)
class Replay:
    """A finding's scenario on the other build: the first run (the evidence shown), then the repeated ones."""

    first: Outcome
    runs: int
    hits: int
    first_shows: bool

    def record(self) -> OtherBuildReplay:
        """What the diff report says of it."""
        lines = (self.first.error or "").strip().splitlines()
        shown = tuple(ReplayedFinding(g.check, g.key, first_line(g.error)) for g in self.first.findings)
        return OtherBuildReplay(not self.first.findings, lines[-1][:300] if lines else None, shown, self.runs,
                                self.hits)


def replay(build: Build, f: Finding, runs: int = REPEAT, max_seconds: float = REPEAT_SECONDS) -> Replay:
    """``f``'s scenario on ``build``: once; then, unless that showed it, after its sequence and ``runs``
    times alone in a fresh worker, stopping early only where time runs out (`confirm.hits_alone`'s bar)."""
    assert f.scenario is not None, "a report's findings come from scenarios that ran"
    first = build.run(f.scenario)

    def shows(out: Outcome) -> bool:
        return any(same_bug(g, f) for g in out.findings)
    if shows(first):
        return Replay(first, 1, 1, True)
    made, hits = 1, 0
    sequence = _sequence(f)
    if sequence:
        h, n = build.repeat(f.scenario, shows, sequence, 1, max_seconds)
        made, hits = made + n, hits + h
    h, n = build.repeat(f.scenario, shows, (), runs, max_seconds)
    return Replay(first, made + n, hits + h, False)


def _sequence(f: Finding) -> Sequence[Scenario]:
    c = f.confirmation
    return c.sequence if c is not None and c.status == "order-dependent" else ()


def repeat_runs(run: Callable[[Scenario], Outcome], fresh: Callable[[], object], sc: Scenario,
                shows: Callable[[Outcome], bool], before: Sequence[Scenario], runs: int,
                max_seconds: float) -> tuple[int, int]:
    """``(hits, made)``: ``sc`` run ``runs`` times in one fresh worker (after ``before``, once), ``made`` fewer
    when ``max_seconds`` ran out first; in how many it ``shows``."""
    fresh()
    for b in before:
        run(b)
    t0, hits, made = time.perf_counter(), 0, 0
    while made < runs and (made == 0 or time.perf_counter() - t0 < max_seconds):
        hits += shows(run(sc))
        made += 1
    return hits, made


def classify(base_found: list[Finding], head_found: list[Finding], base: Build, head: Build) -> list[DiffEntry]:
    """Every finding of either build, with its status and the other build's replay, numbered 1..n in
    `STATUSES` order."""
    entries: list[DiffEntry] = []
    shown_on_head: list[Finding] = []
    for fb in base_found:
        r = replay(head, fb)
        shown_on_head += [g for g in r.first.findings if same_bug(g, fb)]
        entries.append(_entry(_status_of_base(fb, r), fb, "base", r))
    for fh in head_found:
        if any(same_bug(fh, g) for g in list(base_found) + shown_on_head):
            continue
        r = replay(base, fh)
        entries.append(_entry(_status_of_head(fh, r, base.version), fh, "head", r))
    entries.sort(key=lambda e: STATUSES.index(e.status))
    return [replace(e, n=n) for n, e in enumerate(entries, 1)]


def _status_of_base(fb: Finding, r: Replay) -> str:
    """A base finding head's replays never show is fixed only when head's run went past where base failed;
    a head that raised earlier, or whose run zerostate could not observe (a harness error: the tracer broke),
    has not been judged there: ``not-reached``."""
    if r.first_shows:
        return "unchanged"
    if r.hits:
        return "intermittent"
    return "fixed" if reached(fb, r.first) else "not-reached"


def _step_of(f: Finding) -> int:
    """The train step (0-based) at which ``f`` showed on its build: an oracle difference's step, the step of a
    spec's violating event, the step an exception ended; 0 when its run left no trace."""
    o = f.evidence.oracle
    if f.check == "oracle" and o is not None and o.step is not None:
        return o.step
    trace = list(f.trace or ())
    upto = f.index if f.index is not None and f.index < len(trace) else len(trace)
    return sum(e.kind is EventKind.STEP for e in trace[:upto])


def reached(f: Finding, out: Outcome) -> bool:
    """The other build's run of ``f``'s scenario went past the train step where ``f`` showed: it finished, or
    raised later; never when zerostate could not observe it."""
    if any(harness_error(g) for g in out.findings):
        return False
    if out.error is None:
        return True
    done = sum(e.kind is EventKind.STEP for e in out.trace)
    return done > _step_of(f)


def _status_of_head(fh: Finding, r: Replay, base_version: str | None) -> str:
    """A head finding base does not show: unmasked when base stopped earlier or another bug changed its
    course and a known issue of base explains it -- unless base's run shows that very known issue by
    another mechanism (a swap of one failure for another: introduced)."""
    if r.first_shows:
        return "unchanged"
    if r.hits:
        return "intermittent"
    masked = bool(r.first.error or r.first.findings)  # base raised, or another bug changed its course
    label = _label_id(_on_release(fh, base_version)) if base_version else None
    if not (masked and label is not None):
        return "introduced"
    swapped = any(_label_id(g) == label for g in r.first.findings)
    return "introduced" if swapped else "unmasked"


def _on_release(f: Finding, version: str) -> Finding:
    """``f`` as if found on ``version``: what a known issue of that release would say of it."""
    return replace(f, deepspeed=version)


def _label_id(f: Finding) -> str | None:
    """The id of the known issue explaining ``f`` on its release, or None."""
    from zerostate.known.labels import label
    lab = label(f)
    return str(lab["id"]) if lab else None


def _entry(status: str, f: Finding, side: str, other: Replay) -> DiffEntry:
    from zerostate.known.labels import annotate
    assert f.scenario is not None, "a report's findings come from scenarios that ran"
    return DiffEntry(status, side, f.check, f.key, f.error, f.scenario.to_dict(), f.scenario.describe(),
                     Labels.of(annotate(f)), other.record())


def first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text and text.strip() else ""


__all__ = ["Build", "Replay", "STATUSES", "classify", "first_line", "mechanism", "repeat_runs", "replay",
           "same_bug"]
