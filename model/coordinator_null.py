"""A coordinator half that does nothing: ZeRO stages 1 and 2 have no parameter coordinator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .events import Event

if TYPE_CHECKING:
    from .machine import Ctx
    from .network import Network


@dataclass(frozen=True)
class NullCoordinator:
    name: str = "none"
    release: str = "-"
    summary: str = "no parameter coordinator (ZeRO-1/2)"
    provenance: tuple[str, ...] = ()

    def initial(self, net: Network) -> None:
        return None

    def react(self, state: Any, event: Event, ctx: Ctx) -> tuple[Any, tuple[Event, ...]]:
        return state, ()


NULL_COORDINATOR = NullCoordinator()

__all__ = ["NULL_COORDINATOR", "NullCoordinator"]
