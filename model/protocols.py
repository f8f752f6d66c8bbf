"""The protocols the model's pluggable parts implement, so a design is a typed value, not duck typing.

* `CoordinatorHalf`: the ZeRO-3 parameter coordinator of a design (`coordinator_designs.CoordinatorDesign`,
  or `coordinator_null.NullCoordinator` for ZeRO-1/2): ``initial(net)`` gives its state, ``react(state,
  event, ctx)`` the next state and the effect events it emits for one driver or hook event.
* `Monitor`: a spec (`zerostate.specs.Spec`) as the model's explorer and `fold.MonitorBank` fold it:
  ``init()``, ``step(m, event) -> m | Failure``, ``finish(m) -> Failure | str | None``.

The hook half is a plain record (`hook_designs.HookDesign`) read by the one transition function.
A half's state is opaque here (``Any``): each half defines its own immutable record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .events import Event, EventKind
from .failure import Failure

if TYPE_CHECKING:
    from .machine import Ctx
    from .network import Network


@runtime_checkable
class CoordinatorHalf(Protocol):
    # Read-only properties: the halves are frozen dataclasses, whose fields cannot be assigned.
    @property
    def name(self) -> str: ...

    @property
    def release(self) -> str: ...

    @property
    def summary(self) -> str: ...

    @property
    def provenance(self) -> tuple[str, ...]: ...

    def initial(self, net: Network) -> Any: ...

    def react(self, state: Any, event: Event, ctx: Ctx) -> tuple[Any, tuple[Event, ...]]: ...


@runtime_checkable
class Monitor(Protocol):
    """A spec as the one fold (`zerostate.model.fold`) folds it (`zerostate.specs.Spec`)."""

    @property
    def id(self) -> str: ...

    @property
    def reacts_to(self) -> frozenset[EventKind] | None:
        """The kinds ``step`` can change the monitor on (None: every kind)."""
        ...

    def init(self) -> Any: ...

    def step(self, m: Any, event: Event) -> Any: ...

    def finish(self, m: Any) -> Failure | str | None: ...


__all__ = ["CoordinatorHalf", "Monitor"]
