"""The properties every correct design must satisfy, each with its provenance.

Specs read traces only (`zerostate.model.events`), so the same spec judges the
model, the runtime and real DeepSpeed.  ``SPECS`` maps id -> `Spec`;
``METRICS`` maps id -> `Metric` (a quantity, not pass/fail).
"""

from __future__ import annotations

from collections.abc import Iterable

from zerostate.model.events import Event

from .base import Metric, Spec, Violation, check_trace
from .coordinator_specs import COORDINATOR_METRICS, COORDINATOR_SPECS
from .hook_specs import HOOK_SPECS

SPECS: dict[str, Spec] = {s.id: s for s in (*HOOK_SPECS, *COORDINATOR_SPECS)}
METRICS: dict[str, Metric] = {m.id: m for m in COORDINATOR_METRICS}


def specs_for(family: str) -> tuple[Spec, ...]:
    """Specs a design of ``family`` (``hooks``, ``coordinator`` or ``both``) is judged on."""
    return tuple(s for s in SPECS.values() if family == "both" or s.family == family)


def specs_for_stage(stage: int) -> tuple[Spec, ...]:
    """Specs that judge a real run at ZeRO ``stage``: all at 3, the hook specs at 1 and 2 (the coordinator is
    ZeRO-3's), none at 0 (no ZeRO optimizer and no hook manager: the oracle and exceptions judge alone)."""
    return specs_for("both") if stage == 3 else specs_for("hooks") if stage in (1, 2) else ()


def check_all(events: Iterable[Event], specs: Iterable[Spec] | None = None) -> dict[str, Violation | None]:
    """``specs``: None for every spec (an empty collection checks none)."""
    events = list(events)
    return {s.id: check_trace(s, events) for s in (SPECS.values() if specs is None else specs)}


def exercised(events: Iterable[Event], specs: Iterable[Spec] | None = None) -> frozenset[str]:
    """The specs (of ``specs``, default every one) that at least one of ``events`` gives something to judge
    (`Spec.exercised_by`): "ok" needs an observation."""
    kinds = {e.kind for e in events}
    return frozenset(s.id for s in (SPECS.values() if specs is None else specs)
                     if (not s.exercised_by and kinds) or s.exercised_by & kinds)


__all__ = ["METRICS", "Metric", "SPECS", "Spec", "Violation", "check_all", "check_trace", "exercised", "specs_for",
           "specs_for_stage"]
