"""The oracle's verdict on a run, from its record alone: where DeepSpeed first disagrees with plain PyTorch,
the sentence a report shows, and the evidence a known issue's rule reads.

Step by step, as training ran: a generation of TRL's unwrap against the oracle's, then each parameter against
the precision's tolerance (`tolerance`), then in mixed precision the norm of the whole update since the start,
then in bf16 DeepSpeed's fp32 master weights; at the end fp16's loss scaler.  The first disagreement is the
run's; `mismatch_before` says whether one was found before a step (a checkpoint round trip is then judged
against the engine alone, so one divergence is not reported twice)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from zerostate.model.scenario import Scenario

from zerostate.findings.evidence import OracleDiff, ParamDiff
from zerostate.findings.record import Generation, ParamStep, RunRecord, Shape, StepObservation
from zerostate.findings.tolerance import MASTER_RTOL, UPDATE_RATIO, rounding_eps, tolerance

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


@dataclass(frozen=True)
class OracleVerdict:
    """The run's first disagreement with the oracle."""

    message: str
    diff: OracleDiff
    step: int | None
    """The train step after which it showed (None: the loss scaler at the end)."""


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


def update_norm_text(params: Sequence[ParamStep], eps: float) -> str | None:
    """Mixed precision: the norm of the whole update since the start, over every parameter, DeepSpeed's against
    PyTorch's.  The per-element tolerance must absorb the 16-bit rounding of each parameter (about
    ``eps * |p|``), which is as large as a step's update here, so an engine that applies a twentieth of the update
    still passes it; the update's norm over all parameters is not hidden that way.  Judged when PyTorch's update
    is above twice the bound on the rounding noise of DeepSpeed's parameters at both ends (``eps * |params|``);
    None when the ratio is inside `UPDATE_RATIO`."""
    num = den = noise = 0.0
    for p in params:
        if p.got_shape != p.want_shape or p.run_update_sq is None or p.ds_run_update_sq is None:
            continue
        num += p.ds_run_update_sq
        den += p.run_update_sq
        noise += p.want_sq
    num, den, noise = math.sqrt(num), math.sqrt(den), eps * math.sqrt(noise)
    if den <= 2 * noise:
        return None
    ratio = num / den
    if UPDATE_RATIO[0] <= ratio <= UPDATE_RATIO[1]:
        return None
    return (f"the update's norm over all parameters: DeepSpeed {num:.3g}, PyTorch {den:.3g} (ratio {ratio:.3g}, "
            f"outside [{UPDATE_RATIO[0]}, {UPDATE_RATIO[1]}])")


def master_error(masters: Sequence[ParamStep]) -> tuple[float, float, float]:
    """bf16: ``(|DeepSpeed - PyTorch|, |PyTorch - start|, |DeepSpeed - start|)`` of the fp32 master weights, norms
    over every parameter DeepSpeed keeps one of (both sides start from the same bf16-rounded weights)."""
    diff = upd = ds = 0.0
    for p in masters:
        if p.got_shape != p.want_shape or p.run_update_sq is None:
            continue
        diff += p.diff_sq
        upd += p.run_update_sq
        ds += p.ds_run_update_sq or 0.0
    return math.sqrt(diff), math.sqrt(upd), math.sqrt(ds)


def masters_text(masters: Sequence[ParamStep], world_size: int) -> tuple[str | None, float]:
    """bf16: ``(sentence or None, per-element limit)``: None when DeepSpeed's fp32 master weights are within
    `MASTER_RTOL` of PyTorch's update (`master_error`); the limit is the same share of PyTorch's largest
    element-wise update, for the evidence's rows."""
    diff, upd, ds = master_error(masters)
    rtol = MASTER_RTOL[0 if world_size == 1 else 1]
    biggest = max((p.run_update_max for p in masters
                   if p.got_shape == p.want_shape and p.run_update_sq is not None), default=0.0)
    if diff <= rtol * upd + 1e-7:
        return None, rtol * biggest
    return (f"the fp32 master weights: |DeepSpeed - PyTorch| = {diff:.3g} against PyTorch's update {upd:.3g} "
            f"(DeepSpeed's {ds:.3g}); more than {rtol:g} of it"), rtol * biggest


def generation_text(generations: Sequence[Generation], oracle_count: int, atol: float,
                    rtol: float) -> tuple[int, str] | None:
    """None when each generation agrees with the oracle's; else ``(i, sentence)`` for the first that does not
    (i: its index among the scenario's re-registrations)."""
    compared = min(len(generations), oracle_count)
    for i, g in enumerate(generations[:compared]):
        if g.want_shape is None:
            continue
        if g.got_shape != g.want_shape:
            return i, f"output shape {g.got_shape} in DeepSpeed vs {g.want_shape} in PyTorch"
        lim = atol + rtol * g.want_max
        if not g.err_max <= lim:  # NaN too
            return i, f"max |DeepSpeed - PyTorch| of the output = {g.err_max:.3g} > tolerance {lim:.3g}"
    if compared != len(generations):
        return compared, f"{len(generations)} generation(s) in DeepSpeed vs {compared} in PyTorch"
    return None


def oracle_diff(kind: str, step: int | None, rows_of: Sequence[ParamStep] = (), atol: float = 0.0,
                rtol: float = 0.0) -> OracleDiff:
    """How DeepSpeed's parameters (or master weights) after train ``step`` differ from PyTorch's: the parameters
    beyond ``atol + rtol * max|PyTorch|``, worst first, each with DeepSpeed's update projected on PyTorch's
    (``ratio``), on PyTorch's update of the step before (``again``), and whether it is, within the same
    tolerance, an update the oracle's counterfactuals made (``last_only``, ``but_last``); the projection over
    every parameter; the parameters PyTorch left where they were and DeepSpeed moved."""
    num = den = 0.0
    rows: list[ParamDiff] = []
    moved: list[str] = []
    for p in rows_of:
        if p.update_sq is None:
            continue
        num, den = num + p.dot, den + p.update_sq
        lim = atol + rtol * p.want_max
        pt_norm = math.sqrt(p.update_sq)
        if pt_norm == 0.0 and p.ds_update_norm > lim:
            moved.append(p.name)
        if p.err_max > lim:
            again = (p.again_dot / p.again_sq if p.again_sq else None) if p.again_dot is not None else None
            cf = {c.name: c.err_max <= lim for c in p.counterfactuals}
            rows.append(ParamDiff(p.name, p.err_max, p.dot / p.update_sq if p.update_sq > 0 else None, pt_norm,
                                  p.ds_update_norm, again, cf.get("last_only"), cf.get("but_last")))
    rows.sort(key=lambda r: -r.max_abs)
    return OracleDiff(kind, step, tuple(rows[:_ROWS]), num / den if den > 0 else None, tuple(moved))


def _step_verdict(obs: StepObservation, sc: Scenario) -> tuple[str, OracleDiff] | None:
    atol, rtol = tolerance(sc)
    msg = compare_text(obs.params, atol, rtol)
    kind, rows = "params", obs.params
    eps = rounding_eps(sc)
    if not msg and eps and obs.ds_run_start_known:
        msg, kind = update_norm_text(obs.params, eps), "update-norm"
    if not msg and obs.masters is not None:
        msg, atol = masters_text(obs.masters, sc.world_size)
        kind, rtol, rows = "master", 0.0, obs.masters
    if not msg:
        return None
    return f"after train step {obs.step}: {msg}", oracle_diff(kind, obs.step, rows, atol, rtol)


def _reregister_steps(sc: Scenario) -> list[int]:
    """The train steps that begin with a re-registration (TRL's unwrap), in order."""
    return [i for i, st in enumerate(sc.steps) if st.reregister]


def verdict(record: RunRecord, sc: Scenario) -> OracleVerdict | None:
    """The run's first disagreement with the oracle, or None."""
    atol, rtol = tolerance(sc)
    for obs in record.steps:
        gen = generation_text(record.generations[:obs.generations], record.oracle_generations, atol, rtol)
        if gen is not None:
            return OracleVerdict(f"generation before train step {_reregister_steps(sc)[gen[0]]} (TRL's unwrap): "
                                 f"{gen[1]}", OracleDiff("generation", obs.step), obs.step)
        found = _step_verdict(obs, sc)
        if found is not None:
            return OracleVerdict(found[0], found[1], obs.step)
    ls = record.loss_scaling
    if ls is None:
        return None
    skipped = list(ls.pt_skipped) if ls.pt_skipped is not None else None
    scales = list(ls.pt_scales) if ls.pt_scales is not None else None
    if ls.ds_skipped != len(skipped or []):
        return OracleVerdict(f"loss scaling: DeepSpeed skipped {ls.ds_skipped} step(s) for an overflow, PyTorch's "
                             f"loss scaler {len(skipped or [])} (steps {skipped}, scales {scales})",
                             OracleDiff("loss-scaling", None), None)
    if ls.pt_scale is not None and ls.ds_scale != ls.pt_scale:
        # same steps skipped, yet the scale the next step would run with differs: the scaler's update
        return OracleVerdict(f"loss scaling: DeepSpeed's loss scale after the last step is {ls.ds_scale:g}, "
                             f"PyTorch's loss scaler's {ls.pt_scale:g} (both skipped steps {skipped}; the scales "
                             f"the steps ran with {scales})", OracleDiff("loss-scaling", None), None)
    return None


def mismatch_before(record: RunRecord, sc: Scenario, step: int) -> bool:
    """Whether the oracle disagreed after a train step before ``step``."""
    found = verdict(record, sc)
    return found is not None and found.step is not None and found.step < step


__all__ = ["OracleVerdict", "compare_text", "generation_text", "master_error", "masters_text", "mismatch_before",
           "oracle_diff", "update_norm_text", "verdict"]
