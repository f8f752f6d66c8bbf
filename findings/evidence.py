"""What a finding's own run shows, as typed records: the exception (type, message, and the frames it passed,
DeepSpeed's among them) and the oracle's disagreement (which parameters, by how much, which way).

A known issue's rule (`known.issue.KnownIssue.explains`) reads these, the finding's check and code, and its
trace: a label is a mechanism its evidence shows, never the scenario's shape.  Built from a run's record by
`findings.decide` (`raised_of`, `oracle_judgement.oracle_diff`)."""

from __future__ import annotations

from dataclasses import dataclass

from zerostate.findings.record import ExceptionRecord, Frame


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
    master weights), ``generation`` (TRL's unwrap generated something else), ``read`` (the loop's own
    ``GatheredParameters`` read other values than PyTorch's parameters), ``loss-scaling`` (skipped steps
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
    explained_by: tuple[str, ...] | None = None
    """An oracle difference: the known mechanisms whose counterfactual reference DeepSpeed matches at every step
    (`oracle_judgement.explaining`); None when no reference does."""


NO_EVIDENCE = Evidence()
"""A run that shows nothing besides its trace: one shared default, as `Evidence` is frozen."""


_EVIDENCE_FRAMES = 40
"""The innermost frames a rule reads of a raised exception."""


def raised_of(rec: ExceptionRecord | None) -> Raised | None:
    """The `Raised` a rule reads of what a run raised (`record.ExceptionRecord`)."""
    if rec is None:
        return None
    return Raised(rec.type, rec.message, rec.frames[-_EVIDENCE_FRAMES:])


__all__ = ["NO_EVIDENCE", "Evidence", "Frame", "OracleDiff", "ParamDiff", "Raised", "raised_of"]
