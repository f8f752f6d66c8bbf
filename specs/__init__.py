"""The properties every correct design must satisfy, each with its provenance.

Specs read traces only (`zerostate.model.events`), so the same spec judges the
model, the runtime and real DeepSpeed.  ``SPECS`` maps id -> `Spec`;
``METRICS`` maps id -> `Metric` (measured, not pass/fail).
"""

from __future__ import annotations

from .base import Metric, Spec, Violation, check_trace
from .hook_specs import HOOK_SPECS

from .coordinator_specs import COORDINATOR_METRICS, COORDINATOR_SPECS

SPECS: dict[str, Spec] = {s.id: s for s in (*HOOK_SPECS, *COORDINATOR_SPECS)}
METRICS: dict[str, Metric] = {m.id: m for m in COORDINATOR_METRICS}


def specs_for(family: str) -> tuple[Spec, ...]:
    """Specs a design of ``family`` (``hooks``, ``coordinator`` or ``both``) is judged on."""
    return tuple(s for s in SPECS.values() if family == "both" or s.family == family)


def check_all(events, specs=None) -> dict[str, Violation | None]:
    events = list(events)
    return {s.id: check_trace(s, events) for s in (specs or SPECS.values())}


__all__ = ["METRICS", "Metric", "SPECS", "Spec", "Violation", "check_all", "check_trace", "specs_for"]
