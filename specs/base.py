"""What a spec is: an id, a sentence, its provenance, and a monitor over events.

Every spec is checked the same way on every target: it folds a *monitor* over
the events of a trace.  A monitor state is a small hashable value, so the
exhaustive checker can carry monitors inside the product state graph (as a TLA+
invariant is checked on each reachable state), while a finished run is checked
by folding once (`check_trace`).

``step(m, event) -> m`` returns the next monitor state or a `Violation`;
``finish(m)`` returns a `Violation` or None at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from zerostate.model.events import Event


@dataclass(frozen=True)
class Violation:
    spec: str
    message: str
    index: int | None = None
    """Index of the violating event in the trace (None: detected at the end)."""

    def __str__(self) -> str:
        where = f" (event #{self.index})" if self.index is not None else " (at end of run)"
        return f"{self.spec}: {self.message}{where}"


@dataclass(frozen=True)
class Spec:
    id: str
    sentence: str
    provenance: tuple[str, ...]
    family: str
    """``hooks`` (gradient-hook / epilogue protocol) or ``coordinator`` (ZeRO-3 parameters)."""
    init: Callable[[], Any]
    step: Callable[[Any, Event], Any]
    finish: Callable[[Any], str | None]
    checks: str = ""
    """What exactly the monitor checks, in words (for reports and README)."""

    def check(self, events: Iterable[Event]) -> Violation | None:
        return check_trace(self, events)


@dataclass(frozen=True)
class _Failed:
    message: str
    is_violation: bool = True


def fail(message: str) -> _Failed:
    """Return this from a monitor step to report a violation at the current event."""
    return _Failed(message)


def is_failure(m: Any) -> bool:
    """Monitors signal a violation with `fail`; the model's explorer duck-types ``is_violation``."""
    return getattr(m, "is_violation", False) is True


def check_trace(spec: Spec, events: Iterable[Event]) -> Violation | None:
    m = spec.init()
    for i, ev in enumerate(events):
        m = spec.step(m, ev)
        if is_failure(m):
            return Violation(spec.id, m.message, i)
    msg = spec.finish(m)
    return Violation(spec.id, msg) if msg else None


@dataclass(frozen=True)
class Metric:
    id: str
    sentence: str
    provenance: tuple[str, ...]
    measure: Callable[[Iterable[Event], Any], float]
    """(events, network) -> value."""


__all__ = ["Metric", "Spec", "Violation", "check_trace", "fail", "is_failure"]
