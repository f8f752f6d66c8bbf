"""ZeRO-3's persistence threshold as configured.

``deepspeed.initialize`` marks a parameter persistent (``ds_persist``: gathered once and kept, an all-gather
saved per use for its memory) exactly when it has at most ``stage3_param_persistence_threshold`` elements
(``mark_persistent_parameters``; zerostate leaves ``stage3_model_persistence_threshold`` unlimited, so no
running total cuts it short).  The model's network says the same (`model.network.Network.is_persistent`), and
the coordinator's specs judge releases by the set the trace declares: a release that marks another set changes
every all-gather and release after it without any spec seeing an order it forbids.
"""

from __future__ import annotations

from typing import Any

from zerostate.findings.record import Persistent
from zerostate.tracing import compat


def persistence_of(module: Any) -> tuple[Persistent, ...]:
    """Every parameter of ``module`` (a ZeRO-3 engine's): its size and whether the engine marked it persistent
    (`findings.decide` holds it against the threshold)."""
    return tuple(Persistent(name, int(p.ds_numel), compat.is_persistent(p)) for name, p in module.named_parameters())


__all__ = ["persistence_of"]
