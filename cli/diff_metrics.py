"""Gathered-parameter memory and all-gathers of one real DeepSpeed run, and their comparison base vs head.

From a ZeRO-3 trace (`targets.deepspeed.tracer`: FETCH / PREFETCH when a parameter becomes gathered,
RELEASE when it is partitioned again):

* **peak gathered elements**: the largest sum, over the parameters gathered at once, of their element
  counts (`zerostate.model.network.Network.params` gives each parameter's numel) -- the real
  gathered-parameter memory high-water mark of the run, in elements;
* **all-gathers**: parameters brought in, each FETCH of a partitioned parameter or PREFETCH counted once
  (a FETCH noted ``inflight`` only waits on a prefetch already counted).

ZeRO-1/2 gather nothing (no coordinator): only ZeRO-3 scenarios are compared.  A run that raised has a
truncated trace, so only scenarios that ran to the end on both builds are paired.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from zerostate.model.events import EventKind
from zerostate.model.scenario import Scenario


def metrics(scenario: Scenario, events: list[Any]) -> dict[str, int]:
    """``{"peak_elements", "peak_params", "all_gathers"}`` of one traced run."""
    from zerostate.model.network import Network
    numel = {name: p.numel for name, p in Network(scenario).params.items()}
    gathered: set[str] = set()
    size = peak = peak_n = gathers = 0
    for e in events:
        kind = EventKind(getattr(e.kind, "value", e.kind))
        if kind in (EventKind.FETCH, EventKind.PREFETCH) and e.param:
            if not (kind is EventKind.FETCH and e.note == "inflight"):
                gathers += 1
            if e.param not in gathered:
                gathered.add(e.param)
                size += numel.get(e.param, 0)
        elif kind is EventKind.RELEASE and e.param in gathered:
            gathered.discard(e.param)
            size -= numel.get(e.param, 0)
        if size > peak:
            peak = size
        peak_n = max(peak_n, len(gathered))
    return {"peak_elements": peak, "peak_params": peak_n, "all_gathers": gathers}


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
