"""How far DeepSpeed may be from plain PyTorch before the oracle says they disagree, by precision.

The figures behind each constant are in docs/deepspeed-target.md (*The oracle and its tolerance*, *The fp32 master
weights*); here only what each bounds."""

from __future__ import annotations

from zerostate.model.scenario import Precision, Scenario

ATOL = 1e-5
RTOL = 1e-4
BF16_ATOL = 2e-2
BF16_RTOL = 2e-2
FP16_ATOL = 5e-3
FP16_RTOL = 5e-3
MASTER_RTOL = (0.01, 0.1)
"""bf16: how far DeepSpeed's fp32 master weights may be from the mixed-precision oracle's, as a share of the norm
of PyTorch's update since the start, at world size 1 and above it: at world size 1 both sides run the same bf16
operations in the same order; above it DeepSpeed sums the ranks' bf16 gradients where the oracle takes the whole
batch's."""
UPDATE_RATIO = (0.5, 2.0)
"""Mixed precision: the bounds of ``|DeepSpeed's update| / |PyTorch's update|`` (`oracle_judgement`)."""


def tolerance(sc: Scenario) -> tuple[float, float]:
    """``(atol, rtol)`` of the oracle comparison: fp32 (offload too: the same fp32 arithmetic on the CPU) is
    compared tightly; bf16 parameters are rounded to an 8-bit mantissa (against an fp32 oracle); fp16 ones to an
    11-bit mantissa (one rounding: a relative 2**-11), against an oracle that runs the same fp16 forward and
    backward (only the order of DeepSpeed's sums differs)."""
    if sc.precision is Precision.FP16:
        return FP16_ATOL, FP16_RTOL
    if sc.precision is Precision.BF16:
        return BF16_ATOL, BF16_RTOL
    return ATOL, RTOL


def rounding_eps(sc: Scenario) -> float | None:
    """Mixed precision: half a unit in the last place of the parameters' dtype (the update-norm check); None in
    fp32."""
    return {Precision.BF16: 2.0 ** -8, Precision.FP16: 2.0 ** -11}.get(sc.precision)


__all__ = ["ATOL", "BF16_ATOL", "BF16_RTOL", "FP16_ATOL", "FP16_RTOL", "MASTER_RTOL", "RTOL", "UPDATE_RATIO",
           "rounding_eps", "tolerance"]
