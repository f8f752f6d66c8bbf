"""What a run leaves behind for a known issue to be recognised by (`findings.evidence`): the frames of the
exception it raised, and, for an oracle disagreement, which parameters differ and by how much.

Inside the worker, beside `executor`: `frames` reads a traceback, `oracle_diff` compares one train step's
parameters with the oracle's.  Both give plain JSON-serialisable values (the executor's result crosses a
process boundary)."""

from __future__ import annotations

import math
import traceback
from typing import Any, Mapping

_PACKAGES = ("deepspeed", "torch", "transformers", "peft", "zerostate")
_OWN_FOLDERS = ("harness", "tracing", "model", "specs", "runtime", "findings", "known", "targets")
_LAST_FRAMES = 40


def frames(exc: BaseException) -> list[list[Any]]:
    """``[package, file inside it, function, line]`` of each frame of ``exc``'s traceback, outermost first
    (the last `_LAST_FRAMES`).  A file under ``site-packages/deepspeed/`` (or a checkout's ``deepspeed/``
    package) is ``deepspeed``; zerostate's own files are ``zerostate`` -- whatever folder holds them."""
    out = []
    for fr in traceback.extract_tb(exc.__traceback__)[-_LAST_FRAMES:]:
        out.append([*_place(fr.filename), fr.name, fr.lineno or 0])
    return out


def _place(filename: str) -> tuple[str, str]:
    """The package a file belongs to: the rightmost ``/<package>/`` of its path wins (a release cached under
    ``~/.cache/zerostate/deepspeed/0.19.8/site/deepspeed/`` is DeepSpeed's)."""
    norm = filename.replace("\\", "/")
    at, pkg = max((norm.rfind(f"/{p}/"), p) for p in _PACKAGES)
    if at >= 0:
        return pkg, norm[at + len(pkg) + 2:]
    parent, _, name = norm.rpartition("/")
    if parent.rsplit("/", 1)[-1] in _OWN_FOLDERS:  # zerostate's worktree layout (pyproject's package-dir)
        return "zerostate", parent.rsplit("/", 1)[-1] + "/" + name
    return "other", name


def oracle_diff(kind: str, step: int | None, expected: Mapping[str, Any] | None = None,
                got: Mapping[str, Any] | None = None, pt_before: Mapping[str, Any] | None = None,
                ds_before: Mapping[str, Any] | None = None, atol: float = 0.0, rtol: float = 0.0,
                pt_earlier: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """How DeepSpeed's parameters after train ``step`` differ from PyTorch's.  ``kind``: ``params`` (a parameter
    beyond the tolerance), ``update-norm`` (mixed precision: the whole update's norm), ``generation``,
    ``loss-scaling``.  ``params``: the parameters beyond the tolerance, worst first, each ``[name, max |diff|,
    ratio, PyTorch's update norm, DeepSpeed's update norm, again]`` where ``ratio`` is DeepSpeed's update of
    that step projected on PyTorch's (1: the same update, 0.5: half of it, negative: the other way; None when
    PyTorch left it where it was) and ``again`` the same on PyTorch's update of the step before (1: the step
    before's update applied a second time; None at the first step); ``ratio``: over every parameter;
    ``moved``: the parameters PyTorch left unchanged that DeepSpeed moved.  ``pt_earlier``: PyTorch's
    parameters at the start of the step before."""
    out: dict[str, Any] = {"kind": kind, "step": step, "params": [], "ratio": None, "moved": []}
    if expected is None or got is None or pt_before is None or ds_before is None:
        return out
    num = den = 0.0
    rows = []
    for n, e in expected.items():
        a, p0, d0 = got.get(n), pt_before.get(n), ds_before.get(n)
        if a is None or p0 is None or d0 is None or a.shape != e.shape or p0.shape != e.shape or d0.shape != a.shape:
            continue
        e, a, p0, d0 = e.float(), a.float(), p0.float(), d0.float()
        pt, ds = e - p0, a - d0
        pp, dp = pt.pow(2).sum().item(), (ds * pt).sum().item()
        num, den = num + dp, den + pp
        err = (a - e).abs().max().item() if a.numel() else 0.0
        lim = atol + rtol * (e.abs().max().item() if e.numel() else 0.0)
        pt_norm, ds_norm = math.sqrt(pp), ds.norm().item()
        if pt_norm == 0.0 and ds_norm > lim:
            out["moved"].append(n)
        if err > lim:
            rows.append([n, err, dp / pp if pp > 0 else None, pt_norm, ds_norm, _again(ds, p0, pt_earlier, n)])
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


__all__ = ["frames", "oracle_diff"]
