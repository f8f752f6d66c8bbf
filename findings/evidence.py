"""What a finding's own run shows, as typed records: the exception (type, message, and the frames it passed,
DeepSpeed's among them) and the oracle's disagreement (which parameters, by how much, which way).

A known issue's rule (`known.issue.KnownIssue.explains`) reads these, the finding's check and code, and its
trace: a label is a mechanism its evidence shows, never the scenario's shape.  Built from the executor's
result (``frames``, ``oracle_diff``; `harness.evidence`) by `from_result`."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any


@dataclass(frozen=True)
class Frame:
    package: str
    """``deepspeed``, ``torch``, ``zerostate``, ``transformers``, ``peft`` or ``other``."""
    file: str
    """The file inside its package: ``runtime/zero/stage3.py``."""
    function: str
    line: int = 0

    def at(self, file: str, function: str | None = None) -> bool:
        """In DeepSpeed's ``file`` (a path suffix: ``zero/stage3.py``), in ``function`` when given."""
        return (self.package == "deepspeed" and self.file.endswith(file)
                and (function is None or self.function == function))


@dataclass(frozen=True)
class Raised:
    """The exception a run raised."""

    type: str
    message: str
    """Its first line, after the type."""
    frames: tuple[Frame, ...] = ()
    """Every frame of its traceback, outermost first (the last forty)."""

    @property
    def deepspeed_frames(self) -> tuple[Frame, ...]:
        return tuple(f for f in self.frames if f.package == "deepspeed")

    @property
    def innermost_deepspeed(self) -> Frame | None:
        ds = self.deepspeed_frames
        return ds[-1] if ds else None

    def passed(self, file: str, function: str | None = None) -> bool:
        """Some DeepSpeed frame of it is in ``file`` (and ``function``)."""
        return any(f.at(file, function) for f in self.frames)

    def raised_in(self, file: str, function: str | None = None) -> bool:
        """Its innermost DeepSpeed frame is in ``file`` (and ``function``)."""
        f = self.innermost_deepspeed
        return f is not None and f.at(file, function)

    def says(self, *fragments: str) -> bool:
        """Its message holds every one of ``fragments``."""
        return all(s in self.message for s in fragments)


@dataclass(frozen=True)
class ParamDiff:
    param: str
    max_abs: float
    """The largest |DeepSpeed - PyTorch| over its elements after the step."""
    ratio: float | None
    """DeepSpeed's update of the step projected on PyTorch's (1: the same, 0.5: half, 0: none, negative: the
    other way); None when PyTorch left the parameter where it was."""
    pt_norm: float = 0.0
    ds_norm: float = 0.0
    again: float | None = None
    """DeepSpeed's update projected on PyTorch's update of the step before (1: that update applied again)."""
    last_only: bool | None = None
    """DeepSpeed's update of the step is (within the tolerance) the one PyTorch's optimizer makes from the step's
    last backward's gradient alone; None when the oracle made no such counterfactual (a step the scaler skipped,
    a run before it recorded them)."""
    but_last: bool | None = None
    """... the one it makes from the step's gradient without the last backward's share."""


@dataclass(frozen=True)
class OracleDiff:
    kind: str
    """``params`` (a parameter beyond the tolerance), ``update-norm`` (mixed precision: the whole update's
    norm), ``master`` (bf16: the fp32 master weights against the mixed-precision oracle's; its rows compare
    master weights), ``generation`` (TRL's unwrap generated something else), ``loss-scaling`` (skipped steps
    differ)."""
    step: int | None
    params: tuple[ParamDiff, ...] = ()
    """The parameters beyond the tolerance, worst first."""
    ratio: float | None = None
    """DeepSpeed's update projected on PyTorch's over every parameter."""
    moved: tuple[str, ...] = ()
    """Parameters PyTorch left where they were and DeepSpeed moved."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.param for p in self.params)

    def ratios(self) -> tuple[float, ...]:
        return tuple(p.ratio for p in self.params if p.ratio is not None)


@dataclass(frozen=True)
class Evidence:
    raised: Raised | None = None
    oracle: OracleDiff | None = None
    loss_scales: tuple[float, ...] = ()
    """fp16: the loss scale each train step of the PyTorch oracle ran with (its scaler's policy is DeepSpeed's)."""
    loss_scale: float | None = None
    """fp16: DeepSpeed's loss scale at the end of the run."""
    ranks_differ: tuple[str, ...] = ()
    """At world size > 1: the parameters whose gathered values differed between the ranks in this run."""


NO_EVIDENCE = Evidence()
"""A run that shows nothing besides its trace: one shared default, as `Evidence` is frozen."""


_PACKAGES = ("deepspeed", "torch", "transformers", "peft", "zerostate")
_OWN_FOLDERS = ("harness", "tracing", "model", "specs", "runtime", "findings", "known", "targets")
_LAST_FRAMES = 40


def frames_of(exc: BaseException) -> list[list[Any]]:
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


def raised_from(error: str | None, frames: Sequence[Sequence[Any]] | None) -> Raised | None:
    """The `Raised` of an executor result's ``error`` (``"ExcType: message"``) and ``frames``."""
    if not error:
        return None
    first = error.lstrip().splitlines()[0] if error.strip() else ""
    if first.startswith("oracle: "):  # ``oracle: ExcType: message`` (the oracle raised)
        first = first[len("oracle: "):]
    head, _, rest = first.partition(":")  # ``ExcType: message``, or ``ExcType:`` for an empty message
    return Raised(head.strip(), rest.strip(), tuple(Frame(str(p), str(f), str(fn), int(ln or 0))
                                                    for p, f, fn, ln in (frames or ())))


def oracle_from(diff: Mapping[str, Any] | None) -> OracleDiff | None:
    if not diff:
        return None
    return OracleDiff(str(diff.get("kind", "params")), diff.get("step"),
                      tuple(ParamDiff(str(row[0]), float(row[1]), _num(row[2]), float(row[3]), float(row[4]),
                                      _num(row[5]) if len(row) > 5 else None, _flag(row, 6), _flag(row, 7))
                            for row in diff.get("params") or ()),
                      diff.get("ratio"), tuple(diff.get("moved") or ()))


def _flag(row: Sequence[Any], i: int) -> bool | None:
    return None if len(row) <= i or row[i] is None else bool(row[i])


def _num(x: Any) -> float | None:
    return None if x is None else float(x)


def from_result(result: Mapping[str, Any]) -> Evidence:
    """The evidence of an executor result (`executor.execute`)."""
    fp16 = result.get("fp16") or {}
    return Evidence(raised_from(result.get("error"), result.get("frames")), oracle_from(result.get("oracle_diff")),
                    tuple(float(s) for s in fp16.get("oracle_scales") or ()), _num(fp16.get("loss_scale")))


__all__ = ["NO_EVIDENCE", "Evidence", "Frame", "OracleDiff", "ParamDiff", "Raised", "frames_of", "from_result",
           "oracle_from", "raised_from"]
