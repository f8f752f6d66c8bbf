"""Findings from the decider's output: `findings_of` turns `decide.Decision`s into `Finding`s, worded for a
report, and `unique_by_key` keeps one finding per key.  Targets and the watch build their findings here
only, so what a finding says is decided once (`decide`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zerostate.model.events import Event
from zerostate.model.scenario import Scenario

from zerostate.findings.decide import Decision
from zerostate.findings.finding import Finding

_PREFIXED = frozenset({"carried-state", "checkpoint", "persistence", "teardown"})
"""Checks whose message says what the release did, after the release's name."""


def wording(d: Decision, version: str | None, world_size: int = 1) -> str:
    """The text a report shows for ``d`` on DeepSpeed ``version``."""
    if d.across_ranks:
        return f"DeepSpeed {version}, {world_size} ranks: {d.message}"
    if d.check == "oracle":
        return f"DeepSpeed {version} disagrees with PyTorch {d.message}"
    if d.check in _PREFIXED:
        return f"DeepSpeed {version}: {d.message}"
    return d.message


def findings_of(decisions: Iterable[Decision], scenario: Scenario | None, events: Sequence[Event] | None,
                target: str, version: str | None, world_size: int = 1) -> list[Finding]:
    """One `Finding` per decision, each with the run's trace (None for a run that returned none)."""
    trace = tuple(events) if events is not None else None
    return [Finding(d.check, wording(d, version, world_size), scenario, trace, d.index, target, version,
                    origin=d.origin or None, code=d.code, world_size=world_size,
                    evidence=d.evidence) for d in decisions]


def unique_by_key(findings: Iterable[Finding]) -> list[Finding]:
    """The first finding of each key, in order."""
    seen: set[str] = set()
    out = []
    for f in findings:
        if f.key not in seen:
            seen.add(f.key)
            out.append(f)
    return out


__all__ = ["findings_of", "unique_by_key", "wording"]
