"""Gathered-parameter memory and all-gathers compared base vs head, per scenario family.

The metrics of one run (peak gathered elements, all-gathers) are `explorer.gathered`'s; ZeRO-1/2 gather
nothing (no coordinator): only ZeRO-3 scenarios are compared.  A run that raised has a truncated trace, so
only scenarios that ran to the end on both builds are paired.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zerostate.model.scenario import Scenario

from zerostate.reports.json_value import Json, JsonObject

Measured = Mapping[str, int]
"""One run's figures (`explorer.gathered.metrics`): ``peak_elements``, ``peak_params``, ``all_gathers``."""
Pair = tuple[Scenario, Measured, Measured]
"""A scenario both builds ran to the end, with base's figures and head's."""


@dataclass(frozen=True)
class ScenarioFigures:
    """One scenario's figure on both builds: where they differ most in a family, or a regression."""

    scenario: JsonObject
    description: str
    base: int
    head: int
    ratio: float | None
    """head / base; None where only base is 0."""

    def to_json(self) -> dict[str, Json]:
        return {"scenario": self.scenario, "description": self.description, "base": self.base, "head": self.head,
                "ratio": self.ratio}


@dataclass(frozen=True)
class MetricSummary:
    """One figure (peak or all-gathers) over a family: medians, and the head/base ratios."""

    base_median: float
    head_median: float
    median_ratio: float | None
    worst_ratio: float | None
    best_ratio: float | None
    differ_most: ScenarioFigures

    def to_json(self) -> dict[str, Json]:
        return {"base_median": self.base_median, "head_median": self.head_median, "median_ratio": self.median_ratio,
                "worst_ratio": self.worst_ratio, "best_ratio": self.best_ratio,
                "differ_most": self.differ_most.to_json()}


@dataclass(frozen=True)
class FamilyFigures:
    family: str
    scenarios: int
    peak_elements: MetricSummary
    all_gathers: MetricSummary

    def to_json(self) -> dict[str, Json]:
        return {"family": self.family, "scenarios": self.scenarios, "peak_elements": self.peak_elements.to_json(),
                "all_gathers": self.all_gathers.to_json()}


@dataclass(frozen=True)
class Regression:
    """A scenario whose head gathered-parameter peak is beyond base's times (1 + tolerance)."""

    family: str
    figures: ScenarioFigures

    def to_json(self) -> dict[str, Json]:
        return {"family": self.family, **self.figures.to_json()}


@dataclass(frozen=True)
class MemoryComparison:
    tolerance: float
    families: tuple[FamilyFigures, ...]
    regressions: tuple[Regression, ...]

    def to_json(self) -> dict[str, Json]:
        return {"tolerance": self.tolerance, "families": [f.to_json() for f in self.families],
                "regressions": [r.to_json() for r in self.regressions]}


def family(sc: Scenario) -> str:
    """The scenario family a comparison is reported under: the stage and its most telling feature."""
    if any(b.leaf for b in sc.blocks):
        feat = "z3 leaf module"
    elif any(b.checkpoint.value == "non_reentrant" for b in sc.blocks):
        feat = "non-reentrant checkpoint"
    elif any(b.checkpoint.value == "reentrant" for b in sc.blocks):
        feat = "reentrant checkpoint"
    elif any(b.has_frozen for b in sc.blocks):
        feat = "frozen parameters"
    else:
        feat = "plain"
    return f"ZeRO-{sc.stage}, {feat}"


def ratio(base: int, head: int) -> float | None:
    """head / base; 1.0 when both are 0; None (no finite ratio) when only base is 0."""
    if base == 0:
        return 1.0 if head == 0 else None
    return head / base


def compare(pairs: Sequence[Pair], tolerance: float) -> MemoryComparison:
    """Per family: scenarios, base and head medians, median and worst head/base ratio of the peak and of
    the all-gathers, the scenario where they differ most; plus the regressions (peak beyond 1 + tolerance,
    or a peak appearing where base had none)."""
    fams: dict[str, list[Pair]] = {}
    for p in pairs:
        fams.setdefault(family(p[0]), []).append(p)
    families, regressions = [], []
    for name in sorted(fams):
        rows = fams[name]
        families.append(FamilyFigures(name, len(rows), _summary(rows, "peak_elements"), _summary(rows, "all_gathers")))
        for sc, b, h in rows:
            r = ratio(b["peak_elements"], h["peak_elements"])
            if r is None or r > 1.0 + tolerance:
                regressions.append(Regression(name, ScenarioFigures(sc.to_dict(), sc.describe(), b["peak_elements"],
                                                                    h["peak_elements"], r)))
    return MemoryComparison(tolerance, tuple(families), tuple(regressions))


def _summary(rows: list[Pair], metric: str) -> MetricSummary:
    ratios = [ratio(b[metric], h[metric]) for _, b, h in rows]
    finite = [r for r in ratios if r is not None]
    most = max(range(len(rows)), key=lambda i: (_distance(ratios[i]), abs(rows[i][2][metric] - rows[i][1][metric])))
    sc, b, h = rows[most]
    return MetricSummary(statistics.median(b[metric] for _, b, _ in rows),
                         statistics.median(h[metric] for _, _, h in rows),
                         statistics.median(finite) if finite else None, max(finite) if finite else None,
                         min(finite) if finite else None,
                         ScenarioFigures(sc.to_dict(), sc.describe(), b[metric], h[metric], ratios[most]))


def _distance(r: float | None) -> float:
    return math.inf if r is None else abs(math.log(r)) if r > 0 else math.inf


__all__ = ["FamilyFigures", "MemoryComparison", "MetricSummary", "Regression", "ScenarioFigures", "compare",
           "family", "ratio"]
