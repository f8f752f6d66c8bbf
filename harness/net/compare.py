"""Parameters by name as both sides report them, and the element-wise size helper the worker's observations use
(`harness.observe`); the tolerances are `findings.tolerance`'s, the judgement `findings.oracle_judgement`'s."""

from __future__ import annotations

import torch

Params = dict[str, torch.Tensor]
"""Parameters by name, as a backend reports them after a train step."""


def max_abs(t: torch.Tensor) -> float:
    """The largest |element| of ``t``; 0 for a tensor with no elements (``empty_param``)."""
    return t.abs().max().item() if t.numel() else 0.0


__all__ = ["Params", "max_abs"]
