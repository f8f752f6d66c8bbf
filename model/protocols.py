"""The protocols the model's pluggable parts implement, so a design is a typed value, not duck typing.

* `CoordinatorHalf`: the ZeRO-3 parameter coordinator of a design (`coordinator_designs.CoordinatorDesign`,
  or `coordinator_null.NullCoordinator` for ZeRO-1/2): ``initial(net)`` gives its state, ``react(state,
  event, ctx)`` the next state and the effect events it emits for one driver or hook event.
* `Monitor`: a spec (`zerostate.specs.Spec`) as the model's explorer and `monitor.MonitorBank` fold it:
  ``init()``, ``step(m, event) -> m | Failure``, ``finish(m) -> Failure | str | None``.

The hook half is a plain record (`hook_designs.HookDesign`) read by the one transition function.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class CoordinatorHalf(Protocol):
    name: str
    release: str
    summary: str
    provenance: tuple[str, ...]

    def initial(self, net: Any) -> Any: ...

    def react(self, state: Any, event: Any, ctx: Any) -> tuple[Any, tuple]: ...


@runtime_checkable
class Monitor(Protocol):
    id: str

    def init(self) -> Any: ...

    def step(self, m: Any, event: Any) -> Any: ...

    def finish(self, m: Any) -> Any: ...


__all__ = ["CoordinatorHalf", "Monitor"]
