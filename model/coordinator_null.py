"""A coordinator half that does nothing: ZeRO stages 1 and 2 have no parameter coordinator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NullCoordinator:
    name: str = "none"
    release: str = "-"
    summary: str = "no parameter coordinator (ZeRO-1/2)"
    provenance: tuple[str, ...] = ()

    def initial(self, net: Any) -> None:
        return None

    def react(self, state: Any, event: Any, ctx: Any) -> tuple[Any, tuple]:
        return state, ()


NULL_COORDINATOR = NullCoordinator()

__all__ = ["NULL_COORDINATOR", "NullCoordinator"]
