"""A finding as a run's report holds it: `FindingEntry`, with its labels (`Labels`, the known issue and
root-cause group) and its confirmation, each serialised to the keys docs/report-format.md lists."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerostate.reports.json_value import Json, JsonObject


@dataclass(frozen=True)
class KnownIssue:
    """The known issue that explains a finding (`known.labels.label`)."""

    id: str
    title: str
    owner: str
    fixed_in: str | None
    upstream_patch: str | None
    nature: str
    """``bug`` or ``limitation`` (DeepSpeed documents it in its own test or log line)."""
    cites: str | None

    @classmethod
    def of(cls, label: Mapping[str, Any]) -> KnownIssue:
        return cls(label["id"], label["title"], label["owner"], label["fixed_in"], label["upstream_patch"],
                   label["nature"], label["cites"])

    @property
    def limitation(self) -> bool:
        return self.nature == "limitation"

    def to_json(self) -> dict[str, Json]:
        return {"id": self.id, "title": self.title, "owner": self.owner, "fixed_in": self.fixed_in,
                "upstream_patch": self.upstream_patch, "nature": self.nature, "cites": self.cites}


@dataclass(frozen=True)
class Labels:
    """What a real DeepSpeed finding is labelled with (`known.labels.annotate`); a model design's has none."""

    known_issue: KnownIssue | None
    group: str
    """Its root-cause group: the known issue's id, else the shape of what went wrong."""
    group_title: str
    harness_error: str | None
    """Why it is zerostate's own failure; None: a finding about DeepSpeed."""

    @classmethod
    def of(cls, annotation: Mapping[str, Any]) -> Labels:
        k = annotation["known_issue"]
        return cls(KnownIssue.of(k) if k else None, annotation["group"], annotation["group_title"],
                   annotation["harness_error"])

    def to_json(self) -> dict[str, Json]:
        return {"known_issue": self.known_issue.to_json() if self.known_issue else None, "group": self.group,
                "group_title": self.group_title, "harness_error": self.harness_error}


@dataclass(frozen=True)
class Confirmation:
    """A finding's replay in a fresh worker before hand-over: its status, and the record the explorer made of
    it (`explorer.confirm.Confirmation.to_dict`), written as it came."""

    status: str
    repeat: int | None
    """Runs of it alone for an intermittent one (``hits`` of them showed it)."""
    hits: int | None
    record: JsonObject


@dataclass(frozen=True)
class AroundEvent:
    """One event shown around the violating one."""

    index: int
    event: str
    violation: bool

    def to_json(self) -> dict[str, Json]:
        return {"index": self.index, "event": self.event, "violation": self.violation}


@dataclass(frozen=True)
class FindingEntry:
    """One finding of a run's report (``report.json``'s ``findings[n - 1]``)."""

    n: int
    check: str
    error: str
    design: str | None
    """The model design that produced it (check, compare, explore --target model)."""
    where: str | None
    """What produced it otherwise (``DeepSpeed 0.19.2``)."""
    blocks: int
    steps: int
    scenario: JsonObject
    description: str
    violation_event: int | None
    events_around: tuple[AroundEvent, ...]
    files: Mapping[str, str]
    """What was written beside it, by role (``scenario``, ``repro``, ``trace_svg``, ...): file names."""
    notes: tuple[str, ...]
    key: str
    replay: str
    """The command that replays it on the target it was found on."""
    replay_release: str | None = None
    """The command that replays it on the real release a ``ds-X.Y.Z`` design models."""
    confirmation: Confirmation | None = None
    sequence: tuple[str, ...] = ()
    """An order-dependent finding's examples to run first, described."""
    shrunk: bool | None = None
    """explore: False while handed over unshrunk, or left as seen; None where the command does not shrink."""
    stage: str | None = None
    """explore, while not shrunk: ``unshrunk`` (shrinking follows) or ``as seen`` (the run ended first)."""
    labels: Labels | None = None

    @property
    def harness_error(self) -> str | None:
        return self.labels.harness_error if self.labels else None

    @property
    def known_issue(self) -> KnownIssue | None:
        return self.labels.known_issue if self.labels else None

    def summary_line(self) -> dict[str, Json]:
        """Its line of explore's JSON summary."""
        return {"check": self.check, "error": self.error, "blocks": self.blocks, "steps": self.steps,
                "scenario": self.scenario, "shrunk": self.shrunk,
                "confirmation": self.confirmation.status if self.confirmation else None,
                **(self.labels.to_json() if self.labels else {})}

    def to_json(self) -> dict[str, Json]:
        out: dict[str, Json] = {
            "n": self.n, "check": self.check, "error": self.error, "design": self.design, "where": self.where,
            "blocks": self.blocks, "steps": self.steps, "scenario": self.scenario, "description": self.description,
            "violation_event": self.violation_event, "events_around": [e.to_json() for e in self.events_around],
            "files": dict(self.files), "notes": list(self.notes), "key": self.key}
        if self.confirmation is not None:
            out["confirmation"] = self.confirmation.record
        if self.sequence:
            out["sequence"] = list(self.sequence)
        out["replay"] = self.replay
        out["replay_release"] = self.replay_release
        if self.shrunk is not None:
            out["shrunk"] = self.shrunk
            if self.stage is not None:
                out["stage"] = self.stage
        if self.labels is not None:
            out.update(self.labels.to_json())
        return out


__all__ = ["AroundEvent", "Confirmation", "FindingEntry", "KnownIssue", "Labels"]
