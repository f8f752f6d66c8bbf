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


@dataclass(frozen=True)
class Violation:
    """What a check reports: the spec, its `Failure`'s message and code, and where in the judged events.

    The one violation type from the monitor to the report: `MonitorBank` folds give (index, `Failure`),
    `zerostate.specs.check_trace` and the state graph (`explore.state_graph`) give `Violation`, and a
    target's ``Finding`` (``targets/base.py``) carries its message, index and code on a scenario."""

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





class MonitorBank:
    """Several spec monitors folded over the same events; the first failure of each spec is kept.

    ``specs`` need only ``id``, ``init()``, ``step(m, event)`` and ``finish(m)`` (`zerostate.specs.Spec`).
    `advance` is pure (tuples of monitor states in and out, for the state graph); `feed` and `finish`
    keep the states and the failures on the bank (for one run)."""

    def __init__(self, specs) -> None:
        self.specs = tuple(specs)
        self.states = self.initial()
        self.failures: dict[str, tuple[int | None, Failure]] = {}
        self.seen = 0

    def initial(self) -> tuple:
        return tuple(s.init() for s in self.specs)

    def advance(self, states: tuple, events, base: int = 0) -> tuple[tuple, dict[str, tuple[int, Failure]]]:
        """Fold ``events`` into every live monitor; a failed monitor becomes `DEAD`.  Returns the new
        states and, per newly failed spec, (index of the event = ``base`` + position, failure)."""
        out, failed = [], {}
        for spec, m in zip(self.specs, states):
            if m is DEAD:
                out.append(m)
                continue
            for i, ev in enumerate(events):
                m = spec.step(m, ev)
                if isinstance(m, Failure):
                    failed[spec.id] = (base + i, m)
                    m = DEAD
                    break
            out.append(m)
        return tuple(out), failed

    def feed(self, events) -> dict[str, tuple[int, Failure]]:
        events = list(events)
        self.states, failed = self.advance(self.states, events, self.seen)
        self.seen += len(events)
        for sid, f in failed.items():
            self.failures.setdefault(sid, f)
        return failed

    def ends(self, states: tuple) -> dict[str, Failure]:
        """End-of-run obligations of the live monitors in ``states``."""
        out = {}
        for spec, m in zip(self.specs, states):
            if m is DEAD:
                continue
            end = spec.finish(m)
            if end:
                out[spec.id] = end if isinstance(end, Failure) else Failure(end)
        return out

    def finish(self) -> dict[str, tuple[int | None, Failure]]:
        for sid, f in self.ends(self.states).items():
            self.failures.setdefault(sid, (None, f))
        return self.failures


class _Dead:
    """The state of a monitor that has failed: it judges nothing more."""

    def __repr__(self) -> str:
        return "<violated>"


DEAD = _Dead()
__all__ = ["DEAD", "Failure", "MonitorBank", "Violation", "fail", "is_failure", "violation"]
