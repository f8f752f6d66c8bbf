"""Gathered-parameter memory and all-gathers of one real ZeRO-3 run, read from its trace.

From a ZeRO-3 trace (`targets.deepspeed.tracer`: FETCH / PREFETCH when a parameter becomes gathered,
RELEASE when it is partitioned again):

* **peak gathered elements**: the largest sum, over the parameters gathered at once, of their element
  counts (`zerostate.model.network.Network.params` gives each parameter's numel) -- the real
  gathered-parameter memory high-water mark of the run, in elements;
* **all-gathers**: parameters brought in, each FETCH of a partitioned parameter or PREFETCH counted once
  (a FETCH noted ``inflight`` only waits on a prefetch already counted).

ZeRO-1/2 gather nothing (no coordinator), and a run that raised, hung or broke the tool has a truncated
trace: `gathered_metrics` gives None for them.  ``zerostate diff`` compares these per scenario (`reports.diff_memory`);
``explore`` writes them into each generated example's row (``examples.jsonl``), so two explorations of one
seed compare them example by example (the fault benchmark's ``memory`` rule).
"""

from __future__ import annotations

from zerostate.model.events import Event, EventKind
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome

CUT_SHORT_CHECKS = frozenset({"hang", "crash", "internal"})
"""Findings whose run's trace is cut short or not DeepSpeed's: no metrics from it."""


def metrics(scenario: Scenario, events: list[Event]) -> dict[str, int]:
    """``{"peak_elements", "peak_params", "all_gathers"}`` of one traced run."""
    from zerostate.model.network import Network
    numel = {name: p.numel for name, p in Network(scenario).params.items()}
    gathered: set[str] = set()
    size = peak = peak_n = gathers = 0
    for e in events:
        kind = e.kind
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


def gathered_metrics(scenario: Scenario, outcome: Outcome) -> dict[str, int] | None:
    """`metrics` of a ZeRO-3 run that ran to its end (no exception, a trace, no hang, crash or tool error);
    None otherwise."""
    if scenario.stage != 3 or outcome.error or not outcome.trace:
        return None
    if any(f.check in CUT_SHORT_CHECKS for f in outcome.findings):
        return None
    return metrics(scenario, outcome.trace)


__all__ = ["CUT_SHORT_CHECKS", "gathered_metrics", "metrics"]
