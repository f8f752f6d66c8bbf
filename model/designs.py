"""The design registry: a design is a value pairing a hook-count half with a coordinator half.

Design names are the DeepSpeed release or PR that first has the logic: the hook-count eras
(``ds-0.18.4``, ``ds-0.18.5``, ``ds-0.18.7``), the coordinator eras (``ds-0.19.2``, ``pr-8130``,
``ds-0.19.3``) and ``zerostate``.  A name from one family is
paired with the other half of the same release, so every design describes a
whole engine and any DeepSpeed release maps to one design
(`design_for_release`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .coordinator_null import NULL_COORDINATOR
from .eras import ERAS, era_of, parse_release
from .hook_designs import DS_0_18_4, DS_0_18_5, DS_0_18_7, ZEROSTATE, HookDesign
from .protocols import CoordinatorHalf


class UnknownDesignError(KeyError):
    """An unknown design name; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


@dataclass(frozen=True)
class Design:
    name: str
    hooks: HookDesign
    coordinator: CoordinatorHalf
    summary: str
    family: str
    """``hooks`` or ``coordinator``: which half this design is named for."""
    expected_correct: bool
    """True for designs every spec should hold on (the fixes); False for known-buggy eras."""


_REGISTRY: dict[str, Design] = {}

_NOT_CORRECT = {
    "ds-0.19.2": "partitions frozen params a non-reentrant recompute saved live (seed 002)",
    "pr-8130": ("fixes seed 002 (saved-tensor-intact holds) but inherits 0.19.2's leak: a module whose "
                "post-backward hook never fires (its input does not require grad) stays gathered past the "
                "backward (released-after-backward); 0.19.3 added the epilogue drain for it"),
}
"""Coordinator designs the exhaustive check does not expect to hold on every spec, and why."""


def register(design: Design) -> Design:
    _REGISTRY[design.name] = design
    return design


def _coordinators() -> Mapping[str, CoordinatorHalf]:
    from .coordinator_designs import COORDINATOR_DESIGNS
    return COORDINATOR_DESIGNS


def _build() -> None:
    coords = _coordinators()
    old = coords.get("ds-0.19.2", NULL_COORDINATOR)
    register(Design("ds-0.18.4", DS_0_18_4, old, DS_0_18_4.summary, "hooks", False))
    register(Design("ds-0.18.5", DS_0_18_5, old, DS_0_18_5.summary, "hooks", False))
    register(Design("ds-0.18.7", DS_0_18_7, old, DS_0_18_7.summary, "hooks", True))
    for name, coord in coords.items():
        if name == "zerostate":
            continue
        register(Design(name, DS_0_18_7, coord, coord.summary, "coordinator", name not in _NOT_CORRECT))
    register(Design("zerostate", ZEROSTATE, coords.get("zerostate", NULL_COORDINATOR),
                    "zerostate: " + ZEROSTATE.summary, "both", True))


def designs() -> dict[str, Design]:
    if not _REGISTRY:
        _build()
    return dict(_REGISTRY)


def get_design(name: str) -> Design:
    known = designs()
    if name not in known:
        raise UnknownDesignError(f"unknown design {name!r}; known designs: {', '.join(sorted(known))}")
    return known[name]


def design_for_release(version: str) -> Design:
    """The design a DeepSpeed release implements (hook half and coordinator half): its row of
    `zerostate.model.eras.ERAS`; releases before the table take its first row, after it its last."""
    v = parse_release(version)
    era = era_of(v) or (ERAS[0] if v < ERAS[0].first else ERAS[-1])
    return designs()[era.design]


__all__ = ["Design", "UnknownDesignError", "design_for_release", "designs", "get_design", "register"]
