"""The report of ``zerostate diff`` as a value: `DiffReport`, which diff.json serialises (and ``--json`` prints)
and diff.md renders (`diff_report`); each finding a `DiffEntry` with the other build's replay."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zerostate.reports.diff_memory import MemoryComparison
from zerostate.reports.finding_entry import KnownIssue, Labels
from zerostate.reports.json_value import Json, JsonObject


@dataclass(frozen=True)
class ReplayedFinding:
    """A finding the other build's first replay showed."""

    check: str
    key: str
    error: str
    """Its first line."""

    def to_json(self) -> dict[str, Json]:
        return {"check": self.check, "key": self.key, "error": self.error}


@dataclass(frozen=True)
class OtherBuildReplay:
    """A finding's scenario replayed on the other build: what the first run showed, and how many of all the
    runs made showed the finding."""

    clean: bool
    error: str | None
    """The last line of what the first run raised, if it raised."""
    findings: tuple[ReplayedFinding, ...]
    runs: int
    hits: int

    def to_json(self) -> dict[str, Json]:
        return {"clean": self.clean, "error": self.error, "findings": [f.to_json() for f in self.findings],
                "runs": self.runs, "hits": self.hits}


@dataclass(frozen=True)
class DiffEntry:
    """One finding of either build: fixed, not-reached, introduced, intermittent, unmasked or unchanged."""

    status: str
    found_on: str
    """``base`` or ``head``."""
    check: str
    key: str
    error: str
    scenario: JsonObject
    description: str
    labels: Labels
    replay: OtherBuildReplay
    """Its scenario on the other build."""
    n: int = 0
    """Its number in the diff (1..n in `diff_classify.STATUSES` order); 0 until numbered."""

    @property
    def other_side(self) -> str:
        return "head" if self.found_on == "base" else "base"

    @property
    def known_issue(self) -> KnownIssue | None:
        return self.labels.known_issue

    @property
    def file(self) -> str:
        """Its scenario file in the report folder."""
        return f"finding_{self.n}.json"

    def to_json(self) -> dict[str, Json]:
        return {"status": self.status, "found_on": self.found_on, "check": self.check, "key": self.key,
                "error": self.error, "scenario": self.scenario, "description": self.description,
                **self.labels.to_json(), f"replay_on_{self.other_side}": self.replay.to_json(), "n": self.n,
                "file": self.file}


@dataclass(frozen=True)
class DiffSide:
    """One build under diff."""

    spec: str
    """As given: a release or a checkout's path."""
    name: str
    """How the report names it (``DeepSpeed 0.19.8``)."""
    deepspeed: str | None
    runs: int
    """Distinct runs made on it (replays included)."""
    exploration: str
    """How its exploration ended: ``complete``, ``time budget spent``, ``interrupted``."""

    def to_json(self) -> dict[str, Json]:
        return {"spec": self.spec, "name": self.name, "deepspeed": self.deepspeed, "runs": self.runs,
                "exploration": self.exploration}


@dataclass(frozen=True)
class DiffReport:
    base: DiffSide
    head: DiffSide
    status: str
    examples: int
    scenarios: tuple[str, ...]
    """Scenario files run on both builds besides the exploration."""
    seed: int | None
    world_size: int
    seconds: float
    counts: Mapping[str, int]
    """Status -> findings, every status of `diff_classify.STATUSES`."""
    findings: tuple[DiffEntry, ...]
    memory: MemoryComparison
    command_line: str
    verdict: str

    def to_json(self) -> dict[str, Json]:
        return {"base": self.base.to_json(), "head": self.head.to_json(), "status": self.status,
                "examples": self.examples, "scenarios": list(self.scenarios), "seed": self.seed,
                "world_size": self.world_size, "seconds": self.seconds, "counts": dict(self.counts),
                "findings": [e.to_json() for e in self.findings], "memory": self.memory.to_json(),
                "command_line": self.command_line, "verdict": self.verdict}


__all__ = ["DiffEntry", "DiffReport", "DiffSide", "OtherBuildReplay", "ReplayedFinding"]
