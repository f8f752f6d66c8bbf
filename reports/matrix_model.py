"""The release matrix's report as a value: `MatrixReport` (finding x column, each cell a `Cell`), which the
matrix's report.json serialises and its report.md renders (`matrix_report`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from zerostate.model.scenario import Scenario

from zerostate.reports.json_value import Json, JsonObject, as_int, as_list, as_object, as_str

PRESENT, ABSENT, CRASHED = "present", "absent", "crashed before"
NOT_EXPLORED = "not explored"


@dataclass(frozen=True)
class Column:
    """One column of the matrix: a DeepSpeed release (``target`` deepspeed) or a model design (model)."""

    name: str
    target: str

    def explore_args(self) -> list[str]:
        return ["--deepspeed", self.name] if self.target == "deepspeed" else ["--target", "model", "--design",
                                                                               self.name]

    def replay_args(self) -> str:
        return f" --deepspeed {self.name}" if self.target == "deepspeed" else f" --target model --design {self.name}"

    def options(self, world_size: int) -> dict[str, str | int]:
        """Its target's options, as `targets.interface.get_target` takes them."""
        if self.target == "deepspeed":
            return {"deepspeed": self.name, "world_size": world_size}
        return {"design": self.name}


@dataclass(frozen=True)
class Cell:
    """A finding on one column: present, absent or crashed before, and what that rests on."""

    status: str
    by: str
    """``exploration`` (its own report has it) or ``replay``."""
    link: str
    """The finding file or the replay record it rests on."""
    replay: str
    """The command that replays it on this column."""
    detail: str

    def to_json(self) -> dict[str, Json]:
        return {"status": self.status, "by": self.by, "link": self.link, "replay": self.replay,
                "detail": self.detail}


@dataclass(frozen=True)
class FoundFinding:
    """A finding as a column's own report.json lists it (what the matrix reads of it)."""

    n: int
    key: str | None
    check: str
    error: str
    known_issue: str | None
    """The id of the known issue its labels name."""
    scenario: JsonObject

    @classmethod
    def of(cls, entry: JsonObject) -> FoundFinding:
        return cls(as_int(entry["n"]) or 0, as_str(entry.get("key")), as_str(entry["check"]) or "",
                   as_str(entry.get("error", "")) or "", as_str(as_object(entry.get("known_issue")).get("id")),
                   as_object(entry["scenario"]))


@dataclass(frozen=True)
class ColumnExploration:
    """One column's ``zerostate explore``: how it ended and what its report says."""

    release: str
    status: str
    """``complete``, ``interrupted`` or ``not explored``."""
    out: str
    """Its report folder, under the matrix's."""
    path: str
    exit: int | None = None
    """Its exit status; None: it never ran."""
    error: str | None = None
    """Why it was not explored."""
    examples: Json = None
    findings: tuple[FoundFinding, ...] = ()
    reliability: Json = None
    deepspeed: Json = None
    report_status: Json = None

    @property
    def explored(self) -> bool:
        return self.status != NOT_EXPLORED

    @classmethod
    def of_report(cls, release: str, exit: int, status: str, out: str, path: str,
                  report: JsonObject) -> ColumnExploration:
        """From the column's own report.json."""
        run = as_object(report["run"])
        return cls(release, status, out, path, exit, examples=run.get("examples_run"),
                   findings=tuple(FoundFinding.of(as_object(f)) for f in as_list(report["findings"])),
                   reliability=report.get("reliability"), deepspeed=run.get("deepspeed"),
                   report_status=report.get("status"))

    def to_json(self) -> dict[str, Json]:
        keys: list[Json] = [f.key for f in self.findings]
        if self.exit is None:  # never ran
            return {"release": self.release, "status": self.status, "error": self.error, "out": self.out,
                    "findings": keys}
        if not self.explored:
            return {"release": self.release, "exit": self.exit, "status": self.status, "out": self.out,
                    "error": self.error, "findings": keys}
        return {"release": self.release, "exit": self.exit, "status": self.status, "out": self.out,
                "examples": self.examples, "reliability": self.reliability, "deepspeed": self.deepspeed,
                "report_status": self.report_status, "findings": keys}


@dataclass(frozen=True)
class MatrixRow:
    """One finding (by key) over every column: where it was first found, and a cell per column that has one."""

    key: str
    check: str
    error: str
    known_issue: str | None
    source: str
    """The first column that found it."""
    source_file: str
    scenario: Scenario
    sequence: tuple[Scenario, ...]
    """An order-dependent finding's examples to run first."""
    world_size: int
    """The matrix's; a replay runs at it, or at the scenario's when that is larger."""
    cells: Mapping[str, Cell] = field(default_factory=dict)
    n: int = 0

    def to_json(self) -> dict[str, Json]:
        return {"key": self.key, "check": self.check, "error": self.error, "known_issue": self.known_issue,
                "source": self.source, "source_file": self.source_file,
                "cells": {r: c.to_json() for r, c in self.cells.items()}, "world_size": self.world_size,
                "n": self.n, "scenario": self.scenario.to_dict(), "description": self.scenario.describe()}


@dataclass(frozen=True)
class MatrixRun:
    """How the matrix ran."""

    examples: int
    seed: int | None
    world_size: int
    cluster: str | None
    side_by_side: bool
    seconds: float
    command_line: str

    def to_json(self) -> dict[str, Json]:
        return {"examples": self.examples, "seed": self.seed, "world size": self.world_size, "cluster": self.cluster,
                "side by side": self.side_by_side, "seconds": self.seconds, "command line": self.command_line}


@dataclass(frozen=True)
class MatrixReport:
    status: str
    releases: tuple[str, ...]
    """The columns' names."""
    target: str
    explorations: Mapping[str, ColumnExploration]
    run: MatrixRun
    findings: tuple[MatrixRow, ...]

    def to_json(self) -> dict[str, Json]:
        return {"command": "explore (release matrix)", "status": self.status, "releases": list(self.releases),
                "target": self.target, "explorations": {r: e.to_json() for r, e in self.explorations.items()},
                "run": self.run.to_json(), "findings": [row.to_json() for row in self.findings]}


__all__ = ["ABSENT", "CRASHED", "Cell", "Column", "ColumnExploration", "FoundFinding", "MatrixReport", "MatrixRow",
           "MatrixRun", "NOT_EXPLORED", "PRESENT"]
