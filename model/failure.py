"""What a spec monitor returns when a trace breaks its property: a `Failure`.

A monitor is a fold ``step(m, event) -> m`` over a trace (``specs/base.py``); returning a
`Failure` instead of the next state reports a violation at that event.  It lives in the model
core, beside the events it judges, so that the model's own explorer and state graph recognise a
failure by type without importing ``zerostate.specs`` (which imports the model).

``code`` is the violation's identity inside its spec (``hook-after-epilogue``,
``no-epilogue``, ...): a finding's key is ``spec:code``, so rewording a message never changes
which findings count as the same bug.  A monitor that gives no code falls back to the message's
shape (``targets/interface.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Failure:
    message: str
    code: str = ""


@dataclass(frozen=True)
class Violation:
    """What a check reports: the spec, its `Failure`'s message and code, and where in the judged events.

    The one violation type from the monitor to the report: the fold (`zerostate.model.fold`) gives (index,
    `Failure`), `zerostate.specs.check_trace` and the state graph (`explore.state_graph`) give `Violation`, and a
    target's ``Finding`` (``targets/interface.py``) carries its message, index and code on a scenario."""

    spec: str
    message: str
    index: int | None = None
    """Index of the violating event in the judged events (None: detected at the end)."""
    code: str = ""
    """The violation's identity inside its spec (``hook-after-epilogue``); "" when the monitor gives none."""

    def __str__(self) -> str:
        where = f" (event #{self.index})" if self.index is not None else " (at end of run)"
        return f"{self.spec}: {self.message}{where}"


def violation(spec_id: str, failed: Failure | str, index: int | None = None) -> Violation:
    """The `Violation` of a monitor's `Failure` (or of a bare message from a ``finish``)."""
    if isinstance(failed, Failure):
        return Violation(spec_id, failed.message, index, failed.code)
    return Violation(spec_id, failed, index)


def fail(message: str, code: str = "") -> Failure:
    """Return this from a monitor step (or finish) to report a violation at the current event."""
    return Failure(message, code)


def is_failure(m: object) -> bool:
    return isinstance(m, Failure)


__all__ = ["Failure", "Violation", "fail", "is_failure", "violation"]
