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

from zerostate.tracing import compat


def persistence_problem(module: Any, threshold: int) -> str | None:
    """None when every parameter of ``module`` (a ZeRO-3 engine's) is persistent exactly when it has at most
    ``threshold`` elements; else the sentence naming those that are not."""
    wrong = []
    for name, p in module.named_parameters():
        numel = int(p.ds_numel)
        expected = numel <= threshold
        if compat.is_persistent(p) != expected:
            wrong.append(f"{name} ({numel} elements) is {'not ' if expected else ''}persistent")
    if not wrong:
        return None
    return (f"stage3_param_persistence_threshold {threshold}: " + "; ".join(wrong[:4])
            + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
            + " (a parameter of at most that many elements is persistent: mark_persistent_parameters)")


__all__ = ["persistence_problem"]
