"""The oracle's judgement: DeepSpeed's parameters (and generations) against plain PyTorch's, and the
tolerance each precision allows (`tolerance`)."""

from __future__ import annotations

import math

import torch

from zerostate.model.scenario import Precision, Scenario

Params = dict[str, torch.Tensor]
"""Parameters by name, as a backend reports them after a train step."""

ATOL = 1e-5
RTOL = 1e-4
BF16_ATOL = 2e-2
BF16_RTOL = 2e-2
FP16_ATOL = 5e-3
FP16_RTOL = 5e-3
MASTER_RTOL = (0.01, 0.1)
"""bf16: how far DeepSpeed's fp32 master weights may be from the mixed-precision oracle's, as a share of the norm
of PyTorch's update since the start (`compare_masters`), at world size 1 and above it.  Measured on 0.19.8
(docs/deepspeed-target.md, *The fp32 master weights*): at world size 1 both sides run the same bf16
operations in the same order (0 in most runs, at most 0.0017: CPU Adam, LoRA); above it DeepSpeed sums the
ranks' bf16 gradients where the oracle takes the whole batch's (at most 0.043)."""
UPDATE_RATIO = (0.5, 2.0)
"""Mixed precision: the bounds of ``|DeepSpeed's update| / |PyTorch's update|`` (`compare_update`)."""


def tolerance(sc: Scenario) -> tuple[float, float]:
    """``(atol, rtol)`` of the oracle comparison: fp32 (offload too: the same fp32 arithmetic on the
    CPU) is compared tightly; bf16 parameters are rounded to an 8-bit mantissa (against an fp32 oracle);
    fp16 ones to an 11-bit mantissa (one rounding: a relative 2**-11 = 0.05 %), against an oracle that
    runs the same fp16 forward and backward (only the order of DeepSpeed's sums differs): 5e-3."""
    if sc.precision is Precision.FP16:
        return FP16_ATOL, FP16_RTOL
    if sc.precision is Precision.BF16:
        return BF16_ATOL, BF16_RTOL
    return ATOL, RTOL


def rounding_eps(sc: Scenario) -> float | None:
    """Mixed precision: half a unit in the last place of the parameters' dtype (`compare_update`); None in fp32."""
    return {Precision.BF16: 2.0 ** -8, Precision.FP16: 2.0 ** -11}.get(sc.precision)


def max_abs(t: torch.Tensor) -> float:
    """The largest |element| of ``t``; 0 for a tensor with no elements (``empty_param``)."""
    return t.abs().max().item() if t.numel() else 0.0


def compare(expected: Params, actual: Params, atol: float = ATOL, rtol: float = RTOL,
            names: tuple[str, str] = ("PyTorch", "DeepSpeed")) -> str | None:
    """None when every parameter agrees; else a sentence naming the worst parameter (``names``: what the two
    sides are called in it)."""
    worst: tuple[str, float, float] | None = None
    for n, e in expected.items():
        a = actual.get(n)
        if a is None or a.shape != e.shape:
            return f"{n}: shape {tuple(e.shape)} in {names[0]} vs {None if a is None else tuple(a.shape)} in {names[1]}"
        err = max_abs(a.float() - e.float())
        lim = atol + rtol * max_abs(e.float())
        if err > lim and (worst is None or err > worst[1]):
            worst = (n, err, lim)
    if worst:
        return f"{worst[0]}: max |{names[1]} - {names[0]}| = {worst[1]:.3g} > tolerance {worst[2]:.3g}"
    return None


def compare_update(initial_pt: Params, expected: Params, initial_ds: Params, actual: Params,
                   eps: float) -> str | None:
    """Mixed precision (bf16 / fp16): the norm of the whole update since the start, over every parameter,
    DeepSpeed's against PyTorch's.  The per-element tolerance of `compare` must absorb bf16's rounding of
    each parameter (about ``eps * |p|``), which is as large as a step's update here, so an engine that
    applies a twentieth of the update (DeepSpeed #7839, ZeRO-0 bf16 on 0.18.4-0.18.5: 0.05 of it) still
    passes it; the update's norm over all parameters is not hidden that way.  Checked when PyTorch's update
    is above twice the bound on the rounding noise of DeepSpeed's parameters at both ends (``eps * |params|``,
    ``eps`` half a unit in the last place: the noise's norm is about 0.8 of it); None when the ratio is
    inside `UPDATE_RATIO` (0.999-1.040 on six correct bf16 / fp16 scenarios at ZeRO 0-3, llama + LoRA
    among them)."""
    num = den = noise = 0.0
    for n, e in expected.items():
        a = actual.get(n)
        if a is None or n not in initial_pt or n not in initial_ds or a.shape != e.shape:
            continue
        num += (a.float() - initial_ds[n].float()).pow(2).sum().item()
        den += (e.float() - initial_pt[n].float()).pow(2).sum().item()
        noise += e.float().pow(2).sum().item()
    num, den, noise = math.sqrt(num), math.sqrt(den), eps * math.sqrt(noise)
    if den <= 2 * noise:
        return None
    ratio = num / den
    if UPDATE_RATIO[0] <= ratio <= UPDATE_RATIO[1]:
        return None
    return (f"the update's norm over all parameters: DeepSpeed {num:.3g}, PyTorch {den:.3g} (ratio {ratio:.3g}, "
            f"outside [{UPDATE_RATIO[0]}, {UPDATE_RATIO[1]}])")


def master_error(initial: Params, expected: Params, got: Params) -> tuple[float, float, float]:
    """bf16: DeepSpeed's fp32 master weights against the mixed-precision oracle's, over the parameters DeepSpeed
    keeps a master copy of: ``(|DeepSpeed - PyTorch|, |PyTorch - start|, |DeepSpeed - start|)`` (norms over
    all of them).  Both sides start from the same bf16-rounded weights, so the first is what the gradients'
    rounding (sums in another order, bf16 reductions) and any mistake of DeepSpeed's left."""
    diff = upd = ds = 0.0
    for n, a in got.items():
        want, start = expected.get(n), initial.get(n)
        if want is None or start is None or want.shape != a.shape or start.shape != a.shape:
            continue
        e, p0 = want.float(), start.float()
        diff += (a.float() - e).pow(2).sum().item()
        upd += (e - p0).pow(2).sum().item()
        ds += (a.float() - p0).pow(2).sum().item()
    return math.sqrt(diff), math.sqrt(upd), math.sqrt(ds)


def compare_masters(initial: Params, expected: Params, got: Params, world_size: int) -> tuple[str | None, float]:
    """bf16: ``(sentence or None, per-element limit)``: None when DeepSpeed's fp32 master weights are within
    `MASTER_RTOL` of PyTorch's update from the mixed-precision oracle's (`master_error`); the limit is the same
    share of PyTorch's largest element-wise update, for the evidence's rows."""
    diff, upd, ds = master_error(initial, expected, got)
    rtol = MASTER_RTOL[0 if world_size == 1 else 1]
    biggest = max((max_abs(expected[n].float() - initial[n].float()) for n in got
                    if n in expected and n in initial and expected[n].shape == initial[n].shape), default=0.0)
    if diff <= rtol * upd + 1e-7:
        return None, rtol * biggest
    return (f"the fp32 master weights: |DeepSpeed - PyTorch| = {diff:.3g} against PyTorch's update {upd:.3g} "
            f"(DeepSpeed's {ds:.3g}); more than {rtol:g} of it"), rtol * biggest


def compare_generated(expected: list[torch.Tensor | None], actual: list[torch.Tensor], atol: float,
                      rtol: float) -> tuple[int, str] | None:
    """None when each generation's output agrees with the oracle's (its share: `schedule.rows_share`; None:
    not compared); else ``(i, sentence)``: the first that does not (i: its index among the scenario's
    re-registrations)."""
    for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
        if e is None:
            continue
        if a.shape != e.shape:
            return i, f"output shape {tuple(a.shape)} in DeepSpeed vs {tuple(e.shape)} in PyTorch"
        err, lim = max_abs(a - e), atol + rtol * max_abs(e)
        if not err <= lim:  # NaN too
            return i, f"max |DeepSpeed - PyTorch| of the output = {err:.3g} > tolerance {lim:.3g}"
    if len(expected) != len(actual):
        return (min(len(expected), len(actual)),
                f"{len(actual)} generation(s) in DeepSpeed vs {len(expected)} in PyTorch")
    return None


__all__ = ["ATOL", "BF16_ATOL", "BF16_RTOL", "FP16_ATOL", "FP16_RTOL", "MASTER_RTOL", "Params", "RTOL", "UPDATE_RATIO",
           "compare", "compare_generated", "compare_masters", "compare_update", "master_error", "max_abs",
           "rounding_eps", "tolerance"]
