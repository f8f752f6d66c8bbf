"""The oracle's verdict on a run, from its record alone: every train step at which DeepSpeed's update differs
from plain PyTorch's, the sentence a report shows, and the evidence a known issue's rule reads.

At every step each parameter's update (after minus before, each side from where it began the step) is held
against PyTorch's, with a tolerance relative to that update and a floor of a few units in the last place of the
parameter's dtype (`update_limit`; the figures in `tolerance`).  fp16 and bf16 compare the fp32 master weights'
updates wherever DeepSpeed keeps one (stage 0 included), and the 16-bit parameters' updates with the 16-bit
floor.  Then a generation of TRL's unwrap against the oracle's, and at the end fp16's loss scaler.  Every step's
difference is kept (`differences`): a known difference at one step never hides another at a later one.
`mismatch_before` says whether one was found before a step (a checkpoint round trip is then judged against the
engine alone, so one divergence is not reported twice)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from zerostate.model.scenario import Gather, Precision, Scenario

from zerostate.findings.evidence import OracleDiff, ParamDiff
from zerostate.findings.record import Generation, LossScaling, ParamStep, RunRecord, Shape, StepObservation
from zerostate.findings.tolerance import ULPS, tolerance, update_rtol

_ROWS = 12
"""The differing parameters the evidence keeps, worst first."""


class Compared(Protocol):
    """One tensor against its reference (`record.Elementwise`, `record.ParamStep`)."""

    @property
    def name(self) -> str: ...
    @property
    def want_shape(self) -> Shape: ...
    @property
    def got_shape(self) -> Shape | None: ...
    @property
    def err_max(self) -> float: ...
    @property
    def want_max(self) -> float: ...


def compare_text(entries: Sequence[Compared], atol: float, rtol: float,
                 names: tuple[str, str] = ("PyTorch", "DeepSpeed")) -> str | None:
    """None when every tensor agrees within ``atol + rtol * max|reference|``; else a sentence naming the first
    whose shape differs, or the worst beyond the tolerance (``names``: the reference and the other side)."""
    worst: tuple[str, float, float] | None = None
    for c in entries:
        if c.got_shape is None or c.got_shape != c.want_shape:
            return f"{c.name}: shape {c.want_shape} in {names[0]} vs {c.got_shape} in {names[1]}"
        lim = atol + rtol * c.want_max
        if c.err_max > lim and (worst is None or c.err_max > worst[1]):
            worst = (c.name, c.err_max, lim)
    if worst:
        return f"{worst[0]}: max |{names[1]} - {names[0]}| = {worst[1]:.3g} > tolerance {worst[2]:.3g}"
    return None


def generation_text(generations: Sequence[Generation], oracle_count: int, atol: float,
                    rtol: float, what: str = "output", unit: str = "generation") -> tuple[int, str] | None:
    """None when each generation agrees with the oracle's; else ``(i, sentence)`` for the first that does not
    (i: its index among the scenario's re-registrations).  ``what`` / ``unit``: the same for the reads of the loop's
    own ``GatheredParameters`` (``"parameters read"``, ``"read"``)."""
    compared = min(len(generations), oracle_count)
    for i, g in enumerate(generations[:compared]):
        if g.want_shape is None:
            continue
        if g.got_shape != g.want_shape:
            return i, f"{what} shape {g.got_shape} in DeepSpeed vs {g.want_shape} in PyTorch"
        lim = atol + rtol * g.want_max
        if not g.err_max <= lim:  # NaN too
            return i, f"max |DeepSpeed - PyTorch| of the {what} = {g.err_max:.3g} > tolerance {lim:.3g}"
    if compared != len(generations):
        return compared, f"{len(generations)} {unit}(s) in DeepSpeed vs {oracle_count} in PyTorch"
    return None


@dataclass(frozen=True)
class StepDifference:
    """One train step at which DeepSpeed's parameters differ from the reference's."""

    step: int | None
    """None: the loss scaler at the end of the run."""
    kind: str
    """``params`` (a parameter's update), ``master`` (an fp32 master weight's update), ``shape``, ``generation``,
    ``read`` (what the loop's own ``GatheredParameters`` read), ``loss-scaling``."""
    message: str
    diff: OracleDiff
    names: tuple[str, ...] = ()
    """Every parameter beyond its limit (the evidence keeps the worst `_ROWS`)."""


def ulp(dtype: str, x: float) -> float:
    """The spacing of ``dtype``'s numbers at magnitude ``x``."""
    bits = {"bfloat16": 7, "float16": 10}.get(dtype, 23)
    if not x > 0 or math.isinf(x):
        return 2.0 ** (-126 - bits) if x == 0 else math.inf
    return 2.0 ** (math.frexp(x)[1] - 1 - bits)


def update_limit(p: ParamStep, kind: str, sc: Scenario) -> float:
    """How far DeepSpeed's update of ``p`` may be from PyTorch's (in mixed precision: beyond each element's
    measured noise, `ParamStep.update_excess_max`): `tolerance.update_rtol` of PyTorch's update plus
    `tolerance.ULPS` units in the last place of ``p``'s dtype at its magnitude.  In mixed precision a parameter
    kept in fp32 (a LoRA adapter, a norm) takes a master weight's share: its update, too, is computed from 16-bit
    gradients."""
    if kind == "params" and p.dtype == "float32" and sc.precision is not Precision.FP32:
        kind = "master"
    return update_rtol(kind, sc) * p.update_max + ULPS * ulp(p.dtype, max(p.want_max, p.err_max))


def _rows(kind: str, step: int, params: Sequence[ParamStep], sc: Scenario) -> tuple[OracleDiff, tuple[str, ...]]:
    """The evidence of one step's comparison: the parameters beyond their limit, worst first (relative to their
    limit), each with DeepSpeed's update projected on PyTorch's, on PyTorch's update of the step before and
    whether an update the oracle's one-step counterfactuals made is it; the projection over every parameter;
    the parameters PyTorch left where they were and DeepSpeed moved."""
    num = den = 0.0
    rows: list[tuple[float, ParamDiff]] = []
    moved: list[str] = []
    for p in params:
        if p.update_sq is None or p.update_err_max is None:
            continue
        num, den = num + p.dot, den + p.update_sq
        lim = update_limit(p, kind, sc)
        err = p.update_excess_max if p.update_excess_max is not None else p.update_err_max  # beyond the noise
        if err <= lim:
            continue
        pt_norm = math.sqrt(p.update_sq)
        if pt_norm == 0.0:
            moved.append(p.name)
        again = (p.again_dot / p.again_sq if p.again_sq else None) if p.again_dot is not None else None
        cf = {c.name: c.err_max <= lim for c in p.counterfactuals}
        rows.append((err / lim if lim > 0 else math.inf,
                     ParamDiff(p.name, p.update_err_max, p.dot / p.update_sq if p.update_sq > 0 else None, pt_norm,
                               p.ds_update_norm, again, cf.get("last_only"), cf.get("but_last"))))
    rows.sort(key=lambda r: -r[0])
    names = tuple(r.param for _, r in rows)
    return OracleDiff(kind, step, tuple(r for _, r in rows[:_ROWS]), num / den if den > 0 else None,
                      tuple(moved)), names


def _worst_text(kind: str, diff: OracleDiff, count: int) -> str:
    worst = diff.params[0]
    what = "the fp32 master weight of " if kind == "master" else ""
    others = f" (and {count - 1} more)" if count > 1 else ""
    ratio = f"{worst.ratio:.3g}" if worst.ratio is not None else "n/a"
    return (f"{what}{worst.param}{others}: |DeepSpeed's update - PyTorch's| = {worst.max_abs:.3g} against "
            f"PyTorch's update {worst.pt_norm:.3g} (norm; DeepSpeed's {worst.ds_norm:.3g}, projected ratio {ratio})")


def step_difference(obs: StepObservation, sc: Scenario) -> StepDifference | None:
    """Whether DeepSpeed's update of the step differs from PyTorch's (see the module docstring)."""
    for p in obs.params:
        if p.got_shape is None or p.got_shape != p.want_shape:
            return StepDifference(obs.step, "shape", f"after train step {obs.step}: {p.name}: shape {p.want_shape} "
                                  f"in PyTorch vs {p.got_shape} in DeepSpeed", OracleDiff("shape", obs.step),
                                  (p.name,))
    mixed = sc.precision is not Precision.FP32
    checks = [("master", obs.masters)] if mixed and obs.masters else []
    checks.append(("params", obs.params))
    for kind, params in checks:
        diff, names = _rows(kind, obs.step, params, sc)
        if names:
            return StepDifference(obs.step, kind, f"after train step {obs.step}: "
                                  f"{_worst_text(kind, diff, len(names))}", diff, names)
    return None


def _reregister_steps(sc: Scenario) -> list[int]:
    """The train steps that begin with a re-registration (TRL's unwrap), in order."""
    return [i for i, st in enumerate(sc.steps) if st.reregister]


def _gather_steps(sc: Scenario) -> list[int]:
    """The train steps with a read under the loop's own ``GatheredParameters``, in order."""
    return [i for i, st in enumerate(sc.steps) if st.gather is Gather.READ]


@dataclass(frozen=True)
class OracleVerdict:
    """Every difference of a run from the oracle, in order; the first is the run's verdict."""

    differences: tuple[StepDifference, ...]

    @property
    def first(self) -> StepDifference:
        return self.differences[0]

    @property
    def message(self) -> str:
        more = len(self.differences) - 1
        return self.first.message + (f" (and at {more} later step(s))" if more else "")

    @property
    def diff(self) -> OracleDiff:
        return self.first.diff

    @property
    def step(self) -> int | None:
        return self.first.step


def differences(steps: Sequence[StepObservation], generations: Sequence[Generation], oracle_generations: int,
                loss_scaling: LossScaling | None, sc: Scenario, reads: Sequence[Generation] = (),
                oracle_reads: int = 0) -> tuple[StepDifference, ...]:
    """Every step at which DeepSpeed differs from the reference these observations compare it with."""
    atol, rtol = tolerance(sc)
    out: list[StepDifference] = []
    generated = read = False
    for obs in steps:
        gen = generation_text(generations[:obs.generations], oracle_generations, atol, rtol)
        if gen is not None and not generated:
            generated = True
            out.append(StepDifference(obs.step, "generation", f"generation before train step "
                                      f"{_reregister_steps(sc)[gen[0]]} (TRL's unwrap): {gen[1]}",
                                      OracleDiff("generation", obs.step)))
        bad = generation_text(reads[:obs.reads], oracle_reads, atol, rtol, "parameters read", "read")
        if bad is not None and not read:
            read = True
            out.append(StepDifference(obs.step, "read", f"what GatheredParameters read in train step "
                                      f"{_gather_steps(sc)[bad[0]]}: {bad[1]}", OracleDiff("read", obs.step)))
        found = step_difference(obs, sc)
        if found is not None:
            out.append(found)
    ls = loss_scaling
    if ls is None:
        return tuple(out)
    skipped = list(ls.pt_skipped) if ls.pt_skipped is not None else None
    scales = list(ls.pt_scales) if ls.pt_scales is not None else None
    if ls.ds_skipped != len(skipped or []):
        out.append(StepDifference(None, "loss-scaling", f"loss scaling: DeepSpeed skipped {ls.ds_skipped} step(s) for "
                                  f"an overflow, PyTorch's loss scaler {len(skipped or [])} (steps {skipped}, scales "
                                  f"{scales})", OracleDiff("loss-scaling", None)))
    elif ls.pt_scale is not None and ls.ds_scale != ls.pt_scale:
        # same steps skipped, yet the scale the next step would run with differs: the scaler's update
        out.append(StepDifference(None, "loss-scaling", f"loss scaling: DeepSpeed's loss scale after the last step is "
                                  f"{ls.ds_scale:g}, PyTorch's loss scaler's {ls.pt_scale:g} (both skipped steps "
                                  f"{skipped}; the scales the steps ran with {scales})",
                                  OracleDiff("loss-scaling", None)))
    return tuple(out)


def verdict(record: RunRecord, sc: Scenario) -> OracleVerdict | None:
    """Every difference of the run from the correct reference, or None when it agrees."""
    found = differences(record.steps, record.generations, record.oracle_generations, record.loss_scaling, sc,
                        record.reads, record.oracle_reads)
    return OracleVerdict(found) if found else None


@dataclass(frozen=True)
class Explanation:
    """The counterfactual reference that explains a run's differences best: its mechanisms, and what is left of
    DeepSpeed's differences against it (nothing: it explains every one)."""

    mechanisms: tuple[str, ...]
    remaining: tuple[StepDifference, ...]


def _order(step: int | None) -> float:
    return math.inf if step is None else float(step)


def explaining(record: RunRecord, sc: Scenario) -> Explanation | None:
    """The counterfactual reference DeepSpeed is as close to as a correct DeepSpeed is to PyTorch, at every step
    where it differs from the correct one, or at least at the first: the one that explains the most steps, with
    the fewest mechanisms; None when none explains even the first difference."""
    correct = verdict(record, sc)
    if correct is None:
        return None
    first = _order(correct.step)
    best: tuple[tuple[bool, float, int], Explanation] | None = None
    for cf in record.counterfactuals:
        if cf.error is not None:
            continue
        left = differences(cf.steps, (), 0, cf.loss_scaling, sc)
        reach = _order(left[0].step) if left else math.inf
        if left and reach <= first:
            continue
        score = (not left, reach, -len(cf.mechanisms))
        if best is None or score > best[0]:
            best = (score, Explanation(cf.mechanisms, left))
    return best[1] if best else None


def mismatch_before(record: RunRecord, sc: Scenario, step: int) -> bool:
    """Whether the oracle disagreed after a train step before ``step``."""
    found = verdict(record, sc)
    return found is not None and found.step is not None and found.step < step


__all__ = ["Explanation", "OracleVerdict", "StepDifference", "compare_text", "differences", "explaining",
           "generation_text", "mismatch_before", "step_difference", "ulp", "update_limit", "verdict"]
