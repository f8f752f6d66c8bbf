"""What an oracle disagreement leaves behind for a known issue to be recognised by (`findings.evidence`):
which parameters differ from PyTorch, by how much, and which way.

Inside the worker, beside `executor`: `oracle_diff` compares one train step's parameters with the oracle's and
gives plain JSON-serialisable values (the executor's result crosses a process boundary).  The exception's
frames are `findings.evidence.frames_of`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

def oracle_diff(kind: str, step: int | None, expected: Mapping[str, Any] | None = None,
                got: Mapping[str, Any] | None = None, pt_before: Mapping[str, Any] | None = None,
                ds_before: Mapping[str, Any] | None = None, atol: float = 0.0, rtol: float = 0.0,
                pt_earlier: Mapping[str, Any] | None = None,
                counterfactuals: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """How DeepSpeed's parameters after train ``step`` differ from PyTorch's.  ``kind``: ``params`` (a parameter
    beyond the tolerance), ``update-norm`` (mixed precision: the whole update's norm), ``master`` (bf16: the
    fp32 master weights, `compare.compare_masters`), ``generation``,
    ``loss-scaling``.  ``params``: the parameters beyond the tolerance, worst first, each ``[name, max |diff|,
    ratio, PyTorch's update norm, DeepSpeed's update norm, again]`` where ``ratio`` is DeepSpeed's update of
    that step projected on PyTorch's (1: the same update, 0.5: half of it, negative: the other way; None when
    PyTorch left it where it was) and ``again`` the same on PyTorch's update of the step before (1: the step
    before's update applied a second time; None at the first step); ``ratio``: over every parameter;
    ``moved``: the parameters PyTorch left unchanged that DeepSpeed moved.  ``pt_earlier``: PyTorch's
    parameters at the start of the step before.  ``counterfactuals``: the oracle's updates of the step from a
    part of its gradient (`harness.net.oracle.Counterfactuals`); with them each row ends with ``last_only`` and
    ``but_last``: whether DeepSpeed's update is, within the tolerance, the one from the step's last backward's
    gradient alone, and the one from the step's gradient without that backward's share (None: not known)."""
    out: dict[str, Any] = {"kind": kind, "step": step, "params": [], "ratio": None, "moved": []}
    if expected is None or got is None or pt_before is None or ds_before is None:
        return out
    num = den = 0.0
    rows = []
    for n, want in expected.items():
        a, p0, d0 = got.get(n), pt_before.get(n), ds_before.get(n)
        if a is None or p0 is None or d0 is None or a.shape != want.shape or p0.shape != want.shape \
                or d0.shape != a.shape:
            continue
        e, a, p0, d0 = want.float(), a.float(), p0.float(), d0.float()
        pt, ds = e - p0, a - d0
        pp, dp = pt.pow(2).sum().item(), (ds * pt).sum().item()
        num, den = num + dp, den + pp
        err = (a - e).abs().max().item() if a.numel() else 0.0
        lim = atol + rtol * (e.abs().max().item() if e.numel() else 0.0)
        pt_norm, ds_norm = math.sqrt(pp), ds.norm().item()
        if pt_norm == 0.0 and ds_norm > lim:
            out["moved"].append(n)
        if err > lim:
            rows.append([n, err, dp / pp if pp > 0 else None, pt_norm, ds_norm, _again(ds, p0, pt_earlier, n),
                         *_counterfactual(ds, counterfactuals, n, lim)])
    out["params"] = sorted(rows, key=lambda r: -r[1])[:12]
    out["ratio"] = num / den if den > 0 else None
    return out


def _again(ds: Any, p0: Any, pt_earlier: Mapping[str, Any] | None, name: str) -> float | None:
    """DeepSpeed's update ``ds`` projected on PyTorch's update of the step before (``p0 - pt_earlier``)."""
    e0 = None if pt_earlier is None else pt_earlier.get(name)
    if e0 is None or e0.shape != p0.shape:
        return None
    prev = p0 - e0.float()
    pp = prev.pow(2).sum().item()
    return (ds * prev).sum().item() / pp if pp > 0 else None


def _counterfactual(ds: Any, counterfactuals: Mapping[str, Any] | None, name: str,
                    lim: float) -> list[bool | None]:
    """``[last_only, but_last]`` (`oracle_diff`) of DeepSpeed's update ``ds`` of parameter ``name``."""
    out: list[bool | None] = []
    for key in ("last_only", "but_last"):
        cf = None if counterfactuals is None else counterfactuals.get(key, {}).get(name)
        out.append(None if cf is None or cf.shape != ds.shape else (ds - cf.float()).abs().max().item() <= lim)
    return out


__all__ = ["oracle_diff"]
