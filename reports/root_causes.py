"""Findings grouped by root cause, as report.md and diff.md list them: one `RootCause` per group of
`known.labels` (the known issue's id, else the shape of what went wrong), in order of first appearance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from zerostate.reports.finding_entry import KnownIssue, Labels


class Labelled(Protocol):
    """A report entry that may carry labels: a run's finding, a diff's."""

    @property
    def n(self) -> int: ...
    @property
    def labels(self) -> Labels | None: ...


@dataclass(frozen=True)
class RootCause:
    key: str
    title: str
    known_issue: KnownIssue | None
    count: int
    findings: tuple[int, ...]


def root_causes(entries: Sequence[Labelled]) -> list[RootCause]:
    """The groups of the labelled ``entries`` (`known.labels.groups`); unlabelled ones are in none."""
    from zerostate.known.labels import groups
    first: dict[str, Labels] = {}
    rows = []
    for e in entries:
        if e.labels is not None:
            first.setdefault(e.labels.group, e.labels)
            rows.append({"n": e.n, "group": e.labels.group, "group_title": e.labels.group_title})
    return [RootCause(g["key"], g["title"], first[g["key"]].known_issue, g["count"], tuple(g["findings"]))
            for g in groups(rows)]


__all__ = ["Labelled", "RootCause", "root_causes"]
