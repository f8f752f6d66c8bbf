"""What a spec is: an id, a sentence, its provenance, and a monitor over events.

Every spec is checked the same way on every target: it folds a *monitor* over
the events of a trace.  A monitor state is a small hashable value, so the
exhaustive checker can carry monitors inside the product state graph (as a TLA+
invariant is checked on each reachable state), while a finished run is checked
by folding once (`check_trace`); both are the one fold of `zerostate.model.fold`.

``step(m, event) -> m`` returns the next monitor state or a `Failure` (`fail(message, code)`);
``finish(m)`` returns a `Failure` (or a bare message) or None at the end of the run.  A
`Violation` is what a check reports: spec, code, message and the violating event's index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterable

from zerostate.model.events import Event, EventKind
from zerostate.model.fold import first_violation
from zerostate.model.failure import Failure, Violation, fail, is_failure, violation


@dataclass(frozen=True)
class Spec:
    id: str
    sentence: str
    provenance: tuple[str, ...]
    family: str
    """``hooks`` (gradient-hook / epilogue protocol) or ``coordinator`` (ZeRO-3 parameters)."""
    init: Callable[[], Any]
    step: Callable[[Any, Event], Any]
    finish: Callable[[Any], Failure | str | None]
    checks: str = ""
    """What exactly the monitor checks, in words (for reports and README)."""
    reacts_to: frozenset[EventKind] | None = None
    """The event kinds ``step`` can change the monitor on or fail at; for every other kind ``step(m, ev)``
    returns ``m`` itself, so a fold may skip them (``zerostate watch``'s online checker dispatches by kind).
    None: every kind.  Stated by each spec, checked on model traces by test_watch."""
    exercised_by: frozenset[EventKind] = frozenset()
    """The events that give it something to judge: a run with none of them leaves it *not exercised* (never
    "ok": an epilogue spec on a run without a user backward has seen nothing).  Empty: any event."""

    def check(self, events: Iterable[Event]) -> Violation | None:
        return check_trace(self, events)


def check_trace(spec: Spec, events: Iterable[Event]) -> Violation | None:
    """``spec``'s first violation on a finished trace, or its end-of-run obligation's (`zerostate.model.fold`)."""
    return first_violation(spec, events)


@dataclass(frozen=True)
class Metric:
    id: str
    sentence: str
    provenance: tuple[str, ...]
    measure: Callable[[Iterable[Event], Any], float]
    """(events, network) -> value."""


__all__ = ["Failure", "Metric", "Spec", "Violation", "check_trace", "fail", "is_failure", "violation"]
