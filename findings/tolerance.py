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
ULPS = 4.0
"""The floor of an update comparison, in units in the last place of the parameter's dtype at its magnitude: a
parameter's value is rounded to its dtype on both sides at both ends of a step, so an update cannot be compared
more finely than that."""

UPDATE_RTOL = {("params", "fp32"): (1e-4, 1e-4), ("params", "mixed"): (1e-3, 1e-3),
               ("master", "bf16"): (2e-2, 5e-2), ("master", "fp16"): (2e-2, 5e-2)}
"""How far DeepSpeed's update of a parameter may be from PyTorch's, as a share of PyTorch's update (max element
over max element), at world size 1 and above it: fp32 parameters (the same arithmetic, sums in another order);
16-bit parameters against the mixed-precision oracle's fp32 masters (their rounding is the `ULPS` floor); the fp32
master weights of bf16 and fp16 training (gradients computed in 16 bits; above world size 1 DeepSpeed sums the
ranks' 16-bit gradients where the oracle takes the whole batch's).  Each is a few times the noise of correct runs
(benchmarks/bench_noise_floor.py, docs/benchmarks-noise.md), and below the errors a bug makes (a tenth of an
update and more).  fp16's masters take bf16's shares: under Adam a later step's update of an element is its
moments' ratio, so an fp16 gradient element rounded in another order moves it by more than its rounding -- noise
the benchmark, which leaves out runs with findings, does not see (docs/benchmarks-noise.md)."""


NOISE_TIMES = 2.0
"""How many times the oracle's measured noise of an update element (`harness.net.oracle.TorchBackend._noise`: the
update from the step's gradient moved by one 16-bit rounding of its size, each way) DeepSpeed's update of that
element may be off before `UPDATE_RTOL` counts (`record.ParamStep.update_excess_max`): its gradient went through
other 16-bit sums than PyTorch's, so an element the precision does not resolve (a gradient near Adam's ``eps``,
whose update is then any share of the learning rate) is noise, not a bug.  Element by element: a bug that moves
the updates the precision resolves is judged as before, however noisy another element of the tensor is."""


def update_rtol(kind: str, sc: Scenario) -> float:
    """`UPDATE_RTOL` of a comparison ``kind`` (``params`` or ``master``) for the scenario's precision and ranks."""
    if kind == "master":
        key = (kind, "fp16" if sc.precision is Precision.FP16 else "bf16")
    else:
        key = (kind, "fp32" if sc.precision is Precision.FP32 else "mixed")
    return UPDATE_RTOL[key][0 if sc.world_size == 1 else 1]


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


__all__ = ["ATOL", "BF16_ATOL", "BF16_RTOL", "FP16_ATOL", "FP16_RTOL", "NOISE_TIMES", "RTOL", "ULPS",
           "UPDATE_RTOL", "rounding_eps", "tolerance", "update_rtol"]
