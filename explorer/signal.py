"""What a run reached, as hashable units: the steering signal.

Two kinds of unit.  **Arcs**: ``("arc", file, arc id)`` for each arc of DeepSpeed's ZeRO files the run
executed (``Outcome.coverage``, in band from the worker: `harness.coverage_probe`).  **Monitor
states**: ``(spec, state shape, event kind)`` for each spec monitor's state after each event of the run's
trace -- DeepSpeed-independent, so the model target has a signal too.  A monitor state holds parameter and
module names; `shape` keeps its structure and drops the names (a set becomes how many it holds, 0, 1 or
more), so a new unit is a new situation of the protocol, not a new network.

`fold` is the round's reduction for the scheduler: examples in sequence position order, each's new units
counted against everything before it (earlier rounds and earlier positions), the union updated as it goes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from zerostate.model.events import Event

from zerostate.explorer.choices import Taken
from zerostate.explorer.steering_schedule import Folded

Unit = tuple[str, str, Hashable]


def shape(x: Any) -> Hashable:
    """A monitor state without the names it holds (module docstring)."""
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, int):
        return max(-1, min(x, 3))
    if isinstance(x, float):
        return "float"
    if isinstance(x, str):
        return x if x.isupper() else "name"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, tuple(shape(getattr(x, f.name)) for f in dataclasses.fields(x)))
    if isinstance(x, (frozenset, set, tuple, list, dict)):
        return (type(x).__name__, min(len(x), 2))
    return type(x).__name__


def monitor_states(events: Sequence[Event]) -> frozenset[Unit]:
    """Every (spec, state shape, event kind) the run's trace drives each spec's monitor through (a step that
    fails keeps the state before it, as `model.fold` does)."""
    from zerostate.model.fold import Fold
    from zerostate.specs import SPECS
    specs = list(SPECS.values())
    fold = Fold(specs, on_failure=lambda *_: None)
    out: set[Unit] = set()
    for ev in events:
        fold.feed(ev)
        for spec in specs:
            if spec.reacts_to is None or ev.kind in spec.reacts_to:
                out.add((spec.id, ev.kind.name, shape(fold.state[spec.id])))
    return frozenset(out)


def arcs(coverage: Mapping[str, Sequence[int]] | None) -> frozenset[Unit]:
    """The run's DeepSpeed arcs (`Outcome.coverage`), as units."""
    return frozenset(("arc", f, i) for f, ids in (coverage or {}).items() for i in ids)


def units(events: Sequence[Event], coverage: Mapping[str, Sequence[int]] | None) -> frozenset[Unit]:
    return monitor_states(events) | arcs(coverage)


def fold(round_in_order: Iterable[tuple[tuple[Taken, ...], frozenset[Unit]]], union: set[Unit]) -> list[Folded]:
    """Each example (its choices, its units), in sequence order: its units new against ``union`` and the
    examples before it; ``union`` grows as it goes."""
    out = []
    for taken, got in round_in_order:
        new = got - union
        union |= new
        out.append(Folded(taken, len(new)))
    return out


__all__ = ["Unit", "arcs", "fold", "monitor_states", "shape", "units"]
