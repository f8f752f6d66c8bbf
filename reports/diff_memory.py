"""Gathered-parameter memory and all-gathers compared base vs head, per scenario family.

The metrics of one run (peak gathered elements, all-gathers) are `explorer.gathered`'s; ZeRO-1/2 gather
nothing (no coordinator): only ZeRO-3 scenarios are compared.  A run that raised has a truncated trace, so
only scenarios that ran to the end on both builds are paired.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from zerostate.explorer.gathered import metrics
from zerostate.model.scenario import Scenario


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


def compare(pairs: list[tuple[Scenario, dict[str, int], dict[str, int]]], tolerance: float) -> dict[str, Any]:
    """Per family: scenarios, base and head medians, median and worst head/base ratio of the peak and of
    the all-gathers, the scenario where they differ most; plus the regressions (peak beyond 1 + tolerance,
    or a peak appearing where base had none)."""
    fams: dict[str, list[tuple[Scenario, dict[str, int], dict[str, int]]]] = {}
    for p in pairs:
        fams.setdefault(family(p[0]), []).append(p)
    out: dict[str, Any] = {"tolerance": tolerance, "families": [], "regressions": []}
    for name in sorted(fams):
        rows = fams[name]
        fam: dict[str, Any] = {"family": name, "scenarios": len(rows)}
        for metric in ("peak_elements", "all_gathers"):
            fam[metric] = _summary(rows, metric)
        out["families"].append(fam)
        for sc, b, h in rows:
            r = ratio(b["peak_elements"], h["peak_elements"])
            if r is None or r > 1.0 + tolerance:
                out["regressions"].append({"family": name, "scenario": sc.to_dict(), "description": sc.describe(),
                                           "base": b["peak_elements"], "head": h["peak_elements"], "ratio": r})
    return out


def _summary(rows: list[tuple[Scenario, dict[str, int], dict[str, int]]], metric: str) -> dict[str, Any]:
    ratios = [ratio(b[metric], h[metric]) for _, b, h in rows]
    finite = [r for r in ratios if r is not None]
    most = max(range(len(rows)), key=lambda i: (_distance(ratios[i]), abs(rows[i][2][metric] - rows[i][1][metric])))
    sc, b, h = rows[most]
    return {"base_median": statistics.median(b[metric] for _, b, _ in rows),
            "head_median": statistics.median(h[metric] for _, _, h in rows),
            "median_ratio": statistics.median(finite) if finite else None,
            "worst_ratio": max(finite) if finite else None,
            "best_ratio": min(finite) if finite else None,
            "differ_most": {"scenario": sc.to_dict(), "description": sc.describe(), "base": b[metric],
                            "head": h[metric], "ratio": ratios[most]}}


def _distance(r: float | None) -> float:
    return math.inf if r is None else abs(math.log(r)) if r > 0 else math.inf


__all__ = ["compare", "family", "metrics", "ratio"]
