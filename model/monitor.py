"""What a spec monitor returns when a trace breaks its property: a `Failure`.

A monitor is a fold ``step(m, event) -> m`` over a trace (``specs/base.py``); returning a
`Failure` instead of the next state reports a violation at that event.  It lives in the model
core, beside the events it judges, so that the model's own explorer and state graph recognise a
failure by type without importing ``zerostate.specs`` (which imports the model).

``code`` is the violation's identity inside its spec (``hook-after-epilogue``,
``no-epilogue``, ...): a finding's key is ``spec:code``, so rewording a message never changes
which findings count as the same bug.  A monitor that gives no code falls back to the message's
shape (``targets/base.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Failure:
    message: str
    code: str = ""


def fail(message: str, code: str = "") -> Failure:
    """Return this from a monitor step (or finish) to report a violation at the current event."""
    return Failure(message, code)


def is_failure(m: object) -> bool:
    return isinstance(m, Failure)


__all__ = ["Failure", "fail", "is_failure"]
