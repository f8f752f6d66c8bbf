"""The worker's observations, as `findings.record` values: tensors in, numbers out.

Beside the executor, inside the worker: `param_steps` compares one train step's parameters with the oracle's,
`comparison` any two sets of tensors, `frames_of` / `exception_record` what was raised.  Nothing here judges:
`findings.decide` does, in the parent, from these numbers alone."""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

import torch

from zerostate.findings.record import (MAX_FRAMES, PACKAGES, Comparison, Counterfactual, Elementwise,
                                       ExceptionRecord, Frame, ParamStep)
from zerostate.findings.tolerance import NOISE_TIMES

Params = Mapping[str, torch.Tensor]


def _max_abs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _finite_max_abs(t: torch.Tensor) -> float:
    """The largest finite |element| (a magnitude a tolerance is taken from), 0 when none is finite."""
    t = t[torch.isfinite(t)]
    return _max_abs(t)


def _diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a - b``, 0 where both are the same non-finite value (both NaN, or the same infinity): a weight a known bug
    makes NaN agrees with the counterfactual that makes it NaN; NaN against a number stays NaN (a difference)."""
    same = ~torch.isfinite(a) & ~torch.isfinite(b) & ((a == b) | (torch.isnan(a) & torch.isnan(b)))
    return torch.where(same, torch.zeros_like(a), a - b)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def comparison(want: Params, got: Params) -> Comparison:
    """Each tensor of ``want`` against ``got``'s of the same name, in ``want``'s order."""
    out = []
    for n, e in want.items():
        a = got.get(n)
        if a is None or a.shape != e.shape:
            out.append(Elementwise(n, _shape(e), None if a is None else _shape(a)))
            continue
        out.append(Elementwise(n, _shape(e), _shape(a), _max_abs(a.float() - e.float()), _max_abs(e.float())))
    return tuple(out)


def _beyond(diff: torch.Tensor, allowed: torch.Tensor) -> float:
    """The largest |element| of ``diff`` beyond ``allowed`` (element-wise), 0 within it."""
    # a non-finite noise (a reference whose weight a known bug made NaN) allows nothing beyond an exact agreement
    return _max_abs((diff.abs() - allowed.nan_to_num(nan=0.0)).clamp(min=0))


def param_steps(expected: Params, got: Params, pt_start: Params | None, ds_start: Params | None,
                pt_earlier: Params | None = None, counterfactuals: Mapping[str, Params] | None = None,
                pt_run_start: Params | None = None, ds_run_start: Params | None = None,
                only_got: bool = False, noise: Params | None = None) -> tuple[ParamStep, ...]:
    """Every parameter of ``expected`` (PyTorch's after the step) against ``got`` (DeepSpeed's), in
    ``expected``'s order; ``only_got``: the parameters ``got`` has (the master weights DeepSpeed keeps).
    ``pt_start`` / ``ds_start``: where each side began the step; ``pt_earlier``: where PyTorch began the step
    before; ``counterfactuals``: the oracle's updates of the step from a part of its gradient;
    ``pt_run_start`` / ``ds_run_start``: where each side began the run; ``noise``: how much of each element of each
    update the 16-bit precision leaves undetermined (the oracle's, `OracleInfo.noise`): the update's and the
    counterfactuals' differences are then also taken beyond it (`ParamStep.update_excess_max`)."""
    out = []
    for n, want in expected.items():
        a = got.get(n)
        if a is None and only_got:
            continue
        if a is None or a.shape != want.shape:
            out.append(ParamStep(n, _shape(want), None if a is None else _shape(a)))
            continue
        dtype = str(a.dtype).removeprefix("torch.")
        e, a = want.float(), a.float()
        err = _diff(a, e)
        fields: dict[str, Any] = {"err_max": _max_abs(err), "want_max": _finite_max_abs(e),
                                  "want_sq": e.pow(2).sum().item(), "diff_sq": err.pow(2).sum().item()}
        p0 = None if pt_start is None else pt_start.get(n)
        d0 = None if ds_start is None else ds_start.get(n)
        if p0 is not None and d0 is not None and p0.shape == want.shape and d0.shape == a.shape:
            p0, d0 = p0.float(), d0.float()
            pt, ds = e - p0, a - d0
            update_err = _diff(ds, pt)
            fields.update(update_sq=pt.pow(2).sum().item(), dot=(ds * pt).sum().item(), ds_update_norm=ds.norm().item(),
                          update_err_max=_max_abs(update_err), update_max=_finite_max_abs(pt))
            e0 = None if pt_earlier is None else pt_earlier.get(n)
            if e0 is not None and e0.shape == p0.shape:
                prev = p0 - e0.float()
                fields.update(again_dot=(ds * prev).sum().item(), again_sq=prev.pow(2).sum().item())
            nz = noise.get(n) if noise else None
            allowed = None
            if nz is not None and nz.shape == ds.shape:
                allowed = NOISE_TIMES * nz.float()
                fields.update(noise_max=_max_abs(nz), update_excess_max=_beyond(update_err, allowed))
            fields["counterfactuals"] = tuple(
                Counterfactual(name, _max_abs(_diff(ds, cf[n].float())) if allowed is None
                               else _beyond(_diff(ds, cf[n].float()), allowed))
                for name, cf in (counterfactuals or {}).items() if n in cf and cf[n].shape == ds.shape)
        r0 = None if pt_run_start is None else pt_run_start.get(n)
        if r0 is not None and r0.shape == want.shape:
            fields.update(run_update_sq=(e - r0.float()).pow(2).sum().item(),
                          run_update_max=_max_abs(e - r0.float()))
            s0 = None if ds_run_start is None else ds_run_start.get(n)
            if s0 is not None and s0.shape == a.shape:
                fields["ds_run_update_sq"] = (a - s0.float()).pow(2).sum().item()
        out.append(ParamStep(n, _shape(want), _shape(a), dtype=dtype, **fields))
    return tuple(out)


def generation(want: torch.Tensor | None, got: torch.Tensor) -> tuple[tuple[int, ...] | None, tuple[int, ...],
                                                                        float, float]:
    """One generation's output against the oracle's: shapes, max |got - want|, max |want|."""
    if want is None or want.shape != got.shape:
        return (None if want is None else _shape(want)), _shape(got), 0.0, 0.0
    return _shape(want), _shape(got), _max_abs(got - want), _max_abs(want)


def _placed(module: str, filename: str) -> tuple[str, str]:
    """The package a frame's code belongs to and its file inside that package, by the module it was imported as
    (its globals' ``__name__``): the same in a checkout folder of any name, an installed wheel, a DeepSpeed
    checkout given by ``--deepspeed-path`` and a repro script's embedded modules.  Code no package of `PACKAGES`
    holds is ``other``, named by its file."""
    parts = module.split(".") if module else []
    tail = filename.replace("\\", "/").rsplit("/", 1)[-1]
    if not parts or parts[0] not in PACKAGES:
        return "other", tail
    inner = parts[1:] if tail == "__init__.py" else parts[1:-1]
    return parts[0], "/".join([*inner, tail])


def frames_of(exc: BaseException) -> tuple[Frame, ...]:
    """Each frame of ``exc``'s traceback, outermost first (the innermost `MAX_FRAMES`), placed by module."""
    walked = list(traceback.walk_tb(exc.__traceback__))[-MAX_FRAMES:]
    out = []
    for frame, line in walked:
        module = str(frame.f_globals.get("__name__", "") or "")
        package, file = _placed(module, frame.f_code.co_filename)
        out.append(Frame(package, file, frame.f_code.co_name, int(line or 0), module))
    return tuple(out)


def exception_record(exc: BaseException, text: str, tail_lines: int, checkpoint_error: bool = False,
                     in_oracle: bool = False) -> ExceptionRecord:
    """What was raised: ``text`` (``"ExcType: message"`` as the caller blanked it), the traceback's last
    ``tail_lines`` lines, the frames."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines(True)[-tail_lines:]
    return ExceptionRecord(text, "".join(tb), frames_of(exc), checkpoint_error, in_oracle)


__all__ = ["comparison", "exception_record", "frames_of", "generation", "param_steps"]
