"""Run one scenario on real DeepSpeed (inside the worker process), traced, beside the PyTorch oracle.

`execute(scenario)` returns a `findings.record.RunRecord`: what the run showed, observed, never judged (the
parent's `findings.decide` does that).  It holds the tracer's events; what was raised (the text, the traceback's
tail, every frame placed in its package, whether it was torch's ``CheckpointError`` or the oracle's own
failure); after every train step each parameter of DeepSpeed's against PyTorch's (`harness.observe.param_steps`:
values, the step's update on both sides, the update since the start, the oracle's counterfactual updates) and,
in bf16, DeepSpeed's fp32 master weights the same way; each generation of TRL's unwrap against the oracle's;
fp16's loss scaler on both sides; each checkpoint round trip's comparisons (`round_trip_record`); the engine's
own report of its settings (`engine.engine_settings`) and, at ZeRO-3, of every parameter's persistence; the
``F.linear`` the engine ran with and whether it was DeepSpeed's after the run (put back:
`restore_torch_linear`); the engines run before the scenario's own; what ``destroy()`` raised.  A scenario
that cannot be trained at all, or not here, is ``skipped`` with the reason (`untrainable`, `unrunnable`, the
oracle's `NothingToDifferentiate`).

The engine is torn down after every scenario (tracer uninstalled, ``engine.destroy()``, ZeRO-3's
module stack cleared, ``torch.nn.functional.linear`` put back, a full ``gc.collect()``; see ``_RUNS``), so one
worker process serves every example.  A scenario that wants engines before its own in the process says so
(``engines_before``): `engine.DeepSpeedBackend` runs them.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from itertools import combinations
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import torch

from zerostate.findings.oracle_judgement import StepDifference, differences, verdict
from zerostate.findings.record import (CheckpointRoundTrip, CounterfactualRun, Counters, EngineSettings, Generation,
                                       LossScaling, ResumeObservation, RunRecord, StepObservation)
from zerostate.harness.net import fp16
from zerostate.harness.net.counterfactual import MECHANISMS, applicable
from zerostate.harness.net.checkpoint import SaveLoadRecord
from zerostate.findings.tolerance import rounding_eps
from zerostate.harness.net.compare import Params
from zerostate.harness.net.dist import without_tmpdir
from zerostate.harness.net.engine import DeepSpeedBackend, build_engine_model, engine_settings
from zerostate.harness.net.oracle import NothingToDifferentiate, OracleInfo, oracle_params
from zerostate.harness.net.persistence import persistence_of
from zerostate.harness.net.schedule import run_schedule
from zerostate.harness.observe import comparison, exception_record, generation, param_steps
from zerostate.model.events import Event
from zerostate.model.scenario import BackwardKind, Family, ParamKind, Precision, Scenario
from zerostate.tracing import compat
from zerostate.tracing.harness_tracer import Tracer

OnStep = Callable[[int, Params], None]
"""``on_step(i, params)``: called after train step ``i`` with the gathered parameters."""

_TORCH_LINEAR = torch.nn.functional.linear
"""torch's own ``F.linear``, taken when the worker imports this module (before any engine).  A ZeRO-3
engine replaces ``torch.nn.functional.linear`` process-wide by DeepSpeed's ``zero3_linear_wrap`` and
never puts it back (known issue ``z3-linear-override-outlives-engine``), so every later example -- its
oracle and its engine, ZeRO-1/2 included -- would run each ``nn.Linear`` through
``LinearFunctionForZeroStage3``: the gradient-hook order changes, and with it which check a finding
hits.  The worker restores it after every example, so examples stay independent; ``engines_before``
makes the carried state a scenario dimension instead."""


@runtime_checkable
class _LinearBackup(Protocol):
    """DeepSpeed's ``InsertPostInitMethodToModuleSubClasses``, which keeps torch's ``F.linear`` it replaced."""

    linear_bk: Callable[..., torch.Tensor]


@runtime_checkable
class _ZeroInitParam(Protocol):
    """A parameter ZeRO-3 has converted (``zero.Init`` or ``deepspeed.initialize``)."""

    ds_id: int


def restore_torch_linear() -> bool:
    """Put torch's ``F.linear`` back if DeepSpeed replaced it; True when it had."""
    orig = _TORCH_LINEAR
    if "deepspeed" in (orig.__module__ or ""):  # imported after an engine already replaced it
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as cls
        if isinstance(cls, _LinearBackup):
            orig = cls.linear_bk
    if torch.nn.functional.linear is orig:
        return False
    torch.nn.functional.linear = orig
    return True


_RUNS = [0]
"""Examples run by this worker.  After every example the worker runs a full collection -- so each example
starts from the same state, whatever ran before: no engine of an earlier example lingers in a reference
cycle with hooks still attached -- and then ``gc.freeze()``s what survives it, so the next example's
collections (its own, and the ones DeepSpeed makes: ``defragment``, ``empty_cache``) scan only that
example's objects; without the freeze every later collection rescanned whatever an example imported first
(transformers' and PEFT's modules), a third of the explorer's time.  What is frozen was alive after a full
collection; an object of it that becomes garbage later is not reclaimed (a few module-level caches, not
engines: those are collected before the freeze)."""


def untrainable(sc: Scenario) -> str | None:
    """Why neither PyTorch nor DeepSpeed can build the optimizer of this scenario, or None."""
    if not any(kind is not ParamKind.FROZEN for b in sc.blocks for kind in (b.norm, b.lin)) and not sc.fused_head:
        return "no trainable parameter: neither PyTorch nor DeepSpeed can build the optimizer"
    return None


def unrunnable(sc: Scenario) -> str | None:
    """Why this scenario cannot run here, or None."""
    if sc.precision is Precision.FP16:
        from deepspeed.accelerator import get_accelerator
        fp16.allow_fp16_on_cpu()  # DeepSpeed's CPU accelerator is told fp16 is supported (torch computes it)
        acc = get_accelerator()
        if not acc.is_fp16_supported():
            return f"fp16 is not supported by DeepSpeed's {acc.device_name()} accelerator on this machine"
        if any(m.backward is BackwardKind.NONSCALAR for _, _, m in sc.micro_steps()):
            return ("fp16 with a non-scalar backward: DeepSpeed requires the loss scaler on every backward "
                    "(engine.backward(loss) or engine.scale(loss).backward(), engine.py _backward_post_hook) and "
                    "engine.scale takes a scalar loss, so a non-scalar backward has no fp16 form to test")
    if sc.family is Family.BLOCKS and not sc.fused_head and all(
            not b.in_optimizer or (b.norm is ParamKind.FROZEN and b.lin is ParamKind.FROZEN) for b in sc.blocks):
        return "no parameter in any optimizer group: neither PyTorch nor DeepSpeed can build the optimizer"
    return None


Perturbation = tuple[tuple[str, float], ...]
"""Tests only: ``(parameter name or "*", factor)``: DeepSpeed's update of those parameters (and of their master
weights) is observed multiplied by the factor -- an injected error on top of a real run's own noise, for the
oracle's tolerance tests."""


def _perturbed(got: Params | None, start: Params | None, perturb: Perturbation) -> Params | None:
    if got is None or start is None or not perturb:
        return got
    out = dict(got)
    for n, t in got.items():
        factor = next((f for name, f in perturb if name in ("*", n)), None)
        if factor is not None and n in start and start[n].shape == t.shape:
            out[n] = start[n] + factor * (t - start[n])
    return out


def execute(sc: Scenario, on_step: OnStep | None = None, perturb: Perturbation = (),
            timing: dict[str, float] | None = None) -> RunRecord:
    """Run ``sc`` on the engine, traced, beside the oracle, and record what it showed.  ``on_step(i, params)``:
    called after train step ``i`` with the gathered parameters (the rank pool reports checksums to the parent
    after every step); ``perturb``: tests only (`Perturbation`); ``timing``: gets ``"oracle"``, the CPU seconds the
    plain-PyTorch references took (the oracle, and the counterfactuals when DeepSpeed differs)."""
    clock = timing if timing is not None else {}
    clock["oracle"] = 0.0
    reason = untrainable(sc)
    if reason:
        return RunRecord(skipped=reason)
    reason = unrunnable(sc)
    if reason:
        fp16.restore_fp16_support()
        return RunRecord(skipped=reason)
    t0 = time.process_time()  # CPU: a share of the run's CPU time, whatever the machine's load
    try:
        oracle_info: OracleInfo = {}
        expected = oracle_params(sc, oracle_info)
    except NothingToDifferentiate as exc:  # neither side can train it
        return RunRecord(skipped=str(exc))
    except Exception as exc:  # noqa: BLE001 -- the oracle itself failed: zerostate's error, reported as such
        return RunRecord(raised=exception_record(exc, f"{type(exc).__name__}: {exc}", 8, in_oracle=True))
    finally:
        clock["oracle"] += time.process_time() - t0
    rec = _Observed()
    backend: DeepSpeedBackend | None = None
    tracer: Tracer | None = None
    model = None
    try:
        model = build_engine_model(sc)
        built_partitioned = sum(isinstance(p, _ZeroInitParam) for p in model.parameters())  # zero_init: by zero.Init
        backend = built = DeepSpeedBackend(sc, model)
        rec.fields["engines_before"] = tuple(built.engines_before)
        rec.fields["torch_linear"] = built.torch_linear
        if sc.stage == 3:
            rec.fields["persistence"] = persistence_of(built.engine.module)
        rec.settings = engine_settings(built.engine, built_partitioned)
        initial_ds = built.params() if rounding_eps(sc) else None  # mixed precision: the update's norm
        masters0 = built.masters() if sc.precision is not Precision.FP32 else None  # the fp32 master weights
        started: dict[str, Any] = {"pt": oracle_info["initial"], "ds": initial_ds or oracle_info["initial"],
                                   "pt_earlier": None, "ds_masters": masters0}  # where each step started, both sides
        rec.start = (started["ds"], masters0)
        tracer = traced = Tracer(built.engine, sc).install()
        counterfactuals = oracle_info.get("counterfactuals") or []
        noise = oracle_info.get("noise") or []

        def after_step(i: int) -> None:
            with traced.paused():
                got = built.params()
                got_masters = built.masters() if masters0 is not None else None
            cf = counterfactuals[i] if i < len(counterfactuals) else None
            cfs = {"last_only": cf["last_only"], "but_last": cf["but_last"]} if cf is not None else None
            seen = _perturbed(got, started["ds"], perturb) or got
            seen_masters = _perturbed(got_masters, started["ds_masters"], perturb)
            nz = noise[i] if i < len(noise) else None
            params = param_steps(expected[i], seen, started["pt"], started["ds"], started["pt_earlier"], cfs,
                                 oracle_info["initial"], initial_ds, noise=nz)
            masters = None
            if seen_masters is not None and started["ds_masters"] is not None:
                masters = param_steps(expected[i], seen_masters, started["pt"], started["ds_masters"],
                                      started["pt_earlier"], cfs, oracle_info["initial"], oracle_info["initial"],
                                      only_got=True, noise=nz)
            rec.steps.append(StepObservation(i, params, masters, len(built.generated), initial_ds is not None,
                                             len(built.reads)))
            rec.seen.append((seen, seen_masters))
            started.update(pt_earlier=started["pt"], pt=expected[i], ds=got, ds_masters=got_masters)
            if on_step is not None:
                on_step(i, got)

        def mark(what: str, **info: object) -> None:
            if what == "resume_end":  # a fresh engine: the tracer follows it (the old one is gone)
                traced.rebind(built.engine)
                resumed = info["record"]
                assert isinstance(resumed, dict)
                counters = resumed["counters"]
                rec.resumes.append(ResumeObservation(
                    resumed["step"], bool(resumed.get("loaded")), resumed.get("destroy_error"),
                    Counters(**counters[0]), Counters(**counters[1]) if len(counters) > 1 else None))
                return
            traced.mark(what, **info)
            if what == "save_load_end":
                step, record = info["step"], info["record"]
                assert isinstance(step, int) and isinstance(record, dict)
                rec.checkpoints.append(round_trip_record(record, expected[step - 1] if step  # type: ignore[arg-type]
                                                         else oracle_info["initial"]))

        try:
            run_schedule(sc, built, mark=mark, after_step=after_step)
        finally:
            rec.fields["masters_unread"] = tuple(built.masters_unread.items())
        if built.unwrapped:
            rec.unwrapped = tuple(built.unwrapped)
        state = built.fp16_state()
        if state is not None:  # the loss scaler: the steps skipped for an overflow and the scale, both sides
            skipped, scales = oracle_info.get("skipped"), oracle_info.get("scales")
            rec.fields["loss_scaling"] = LossScaling(
                state["skipped_steps"], state["loss_scale"], None if skipped is None else tuple(skipped),
                None if scales is None else tuple(scales), oracle_info.get("scale"))
        generated = oracle_info.get("generated") or []
        rec.fields["oracle_generations"] = len(generated)
        rec.fields["generations"] = tuple(
            Generation(*generation(generated[j] if j < len(generated) else None, got))
            for j, got in enumerate(built.generated))
        reads = oracle_info.get("reads") or []
        rec.fields["oracle_reads"] = len(reads)
        rec.fields["reads"] = tuple(Generation(*generation(reads[j] if j < len(reads) else None, got))
                                    for j, got in enumerate(built.reads))
    except Exception as exc:  # noqa: BLE001 -- whatever DeepSpeed (or torch inside it) raised is the finding
        rec.fields["raised"] = exception_record(exc, without_tmpdir(f"{type(exc).__name__}: {exc}"), 12,
                                                checkpoint_error=compat.is_checkpoint_error(exc))
    finally:
        if tracer is not None:
            rec.fields["events"] = tuple(Event.from_dict(d) for d in tracer.events)
            tracer.uninstall()
        if backend is not None:
            rec.fields["teardown_error"] = backend.close()
        compat.clear_globals()
        fp16.restore_fp16_support()  # fp16 on the CPU accelerator: for this example only
        rec.fields["torch_linear_replaced"] = restore_torch_linear()  # a ZeRO-3 engine ran (its own or before)
        del backend, tracer, model
        _RUNS[0] += 1
        gc.collect()
        gc.freeze()
    record = rec.record()
    if rec.seen and verdict(record, sc) is not None:  # only to spare the references when nothing differs
        t0 = time.process_time()
        record = replace(record, counterfactuals=counterfactual_runs(sc, rec, oracle_info["initial"], initial_ds))
        clock["oracle"] += time.process_time() - t0
    return record


def _against(sc: Scenario, rec: _Observed, mechanisms: tuple[str, ...], pt_initial: Params,
             ds_initial: Params | None) -> CounterfactualRun:
    """DeepSpeed's run (its parameters after each step: ``rec.seen``) against the counterfactual reference of
    ``mechanisms``, observed as against the correct one."""
    info: OracleInfo = {}
    try:
        expected = oracle_params(sc, info, mechanisms)
    except Exception as exc:  # noqa: BLE001 -- a reference that cannot be computed is said, never judged
        return CounterfactualRun(mechanisms, error=f"{type(exc).__name__}: {exc}")
    steps = []
    noise = info.get("noise") or []
    pt_start, pt_earlier = info["initial"], None
    ds_start, ds_masters_start = rec.start
    for i, (got, got_masters) in enumerate(rec.seen[:len(expected)]):
        nz = noise[i] if i < len(noise) else None  # this reference's own: its gradients' rounding
        params = param_steps(expected[i], got, pt_start, ds_start, pt_earlier, None, info["initial"], ds_initial,
                             noise=nz)
        masters = None
        if got_masters is not None and ds_masters_start is not None:
            masters = param_steps(expected[i], got_masters, pt_start, ds_masters_start, pt_earlier, None,
                                  info["initial"], info["initial"], only_got=True, noise=nz)
        steps.append(StepObservation(i, params, masters, rec.steps[i].generations, ds_initial is not None,
                                     rec.steps[i].reads))
        pt_start, pt_earlier, ds_start, ds_masters_start = expected[i], pt_start, got, got_masters
    ls = rec.fields.get("loss_scaling")
    if isinstance(ls, LossScaling):
        skipped, scales = info.get("skipped"), info.get("scales")
        ls = LossScaling(ls.ds_skipped, ls.ds_scale, None if skipped is None else tuple(skipped),
                         None if scales is None else tuple(scales), info.get("scale"))
    return CounterfactualRun(mechanisms, tuple(steps), ls)


PAIRS = 28
"""At most this many pairs of mechanisms are tried when no mechanism alone explains a difference: every pair of up
to eight applicable mechanisms (the ranking only orders them).  A cut below that lets the ranking decide, and the
ranking is blind where the update forgets the gradient's scale: Adam's first step moves each element by about the
learning rate whatever its gradient, so every reference of the same signs comes equally close, and a sum whose two
mechanisms together zero a gradient ranks with the rest."""
TRIPLES = 8
"""At most this many triples, tried when no pair explains it either (three known bugs at once: stage 0's fp16
optimizer steps Adam at init, leaves the loss unscaled, and steps it again on an idle step's zero gradients)."""


def counterfactual_runs(sc: Scenario, rec: _Observed, pt_initial: Params,
                        ds_initial: Params | None) -> tuple[CounterfactualRun, ...]:
    """DeepSpeed against the counterfactual reference of each mechanism the scenario can trigger, and, when none
    alone explains every difference, of pairs (a finding may be the sum of two known bugs), those in which one
    explains a part of it first, then of triples when no pair does."""
    names = applicable(sc)
    runs = [_against(sc, rec, (m,), pt_initial, ds_initial) for m in names]
    if any(_explains(r, sc) for r in runs):
        return tuple(runs)
    correct = differences(tuple(rec.steps), (), 0, rec.fields.get("loss_scaling"), sc)
    parts = [r.mechanisms[0] for r in runs if _explains_a_part(r, correct, sc)]
    rank = {r.mechanisms: i for i, r in enumerate(sorted(runs, key=lambda r: _distance(r, sc)))}
    # the other mechanism of a sum may explain nothing alone (its difference hides behind the first's), and two
    # may each hide the other's: pairs of two parts first, then with one, then the rest, up to PAIRS; within each,
    # the pairs of the mechanisms that came closest alone first
    pairs = sorted((p for p in combinations(names, 2) if _combinable(p)),
                   key=lambda p: (-((p[0] in parts) + (p[1] in parts)), rank[(p[0],)] + rank[(p[1],)]))
    for pair in pairs[:PAIRS]:
        runs.append(_against(sc, rec, pair, pt_initial, ds_initial))
    if any(_explains(r, sc) for r in runs):
        return tuple(runs)
    # the triples extending the most pairs that explain a part (the earlier steps, say) first, then those whose
    # pairs came closest
    tried = sorted((r for r in runs if len(r.mechanisms) == 2), key=lambda r: _distance(r, sc))
    pair_rank = {frozenset(r.mechanisms): i for i, r in enumerate(tried)}
    pair_parts = [set(r.mechanisms) for r in tried if _explains_a_part(r, correct, sc)]
    triples = sorted((t for t in combinations(names, 3) if _combinable(t)),
                     key=lambda t: (-sum(p <= set(t) for p in pair_parts), -sum(m in parts for m in t),
                                    min(pair_rank.get(frozenset(p), len(tried)) for p in combinations(t, 2))))
    for triple in triples[:TRIPLES]:
        runs.append(_against(sc, rec, triple, pt_initial, ds_initial))
    return tuple(runs)


def _combinable(names: Sequence[str]) -> bool:
    """No two of them are alternatives (`Mechanism.alternatives`: one DeepSpeed does either, never both)."""
    groups = [MECHANISMS[n].alternatives for n in names if MECHANISMS[n].alternatives]
    return len(groups) == len(set(groups))


def _distance(run: CounterfactualRun, sc: Scenario) -> tuple[float, int, float]:
    """How far DeepSpeed is from the reference (smaller: closer): its first difference's step (later is closer),
    the parameters differing there, the sum of their largest errors."""
    if run.error is not None:
        return (math.inf, 0, 0.0)
    left = differences(run.steps, (), 0, run.loss_scaling, sc)
    if not left:
        return (-math.inf, 0, 0.0)
    first = left[0]
    return (-(first.step if first.step is not None else len(sc.steps)), len(first.names),
            sum(p.max_abs for p in first.diff.params))


def _explains_a_part(run: CounterfactualRun, correct: tuple[StepDifference, ...], sc: Scenario) -> bool:
    """The reference explains some of what differs: its first difference comes later than the correct one's, or
    at the same step with fewer differing parameters, or no more of them and at most half the largest error."""
    if run.error is not None or not correct:
        return False
    left = differences(run.steps, (), 0, run.loss_scaling, sc)
    if not left:
        return True
    first, mine = correct[0], left[0]
    if (mine.step is None) != (first.step is None):
        return mine.step is None
    if mine.step is not None and first.step is not None and mine.step != first.step:
        return mine.step > first.step
    if set(mine.names) < set(first.names):
        return True
    return set(mine.names) <= set(first.names) and _largest(mine) <= _largest(first) / 2


def _largest(d: StepDifference) -> float:
    return max((p.max_abs for p in d.diff.params), default=0.0)


def _explains(run: CounterfactualRun, sc: Scenario) -> bool:
    """DeepSpeed agrees with the reference at every step (the worker's only use of the judgement: whether to
    compute more references)."""
    return run.error is None and not differences(run.steps, (), 0, run.loss_scaling, sc)


class _Observed:
    """The observations of one run as they come in; `record` freezes them."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.steps: list[StepObservation] = []
        self.checkpoints: list[CheckpointRoundTrip] = []
        self.resumes: list[ResumeObservation] = []
        self.settings: EngineSettings | None = None
        self.unwrapped: tuple[int, ...] = ()
        self.seen: list[tuple[Params, Params | None]] = []
        """DeepSpeed's parameters and master weights after each train step (held against counterfactuals)."""
        self.start: tuple[Params, Params | None] = ({}, None)
        """DeepSpeed's parameters and master weights before training."""

    def record(self) -> RunRecord:
        engine = self.settings
        if engine is not None and self.unwrapped:
            engine = replace(engine, unwrap_gathered=self.unwrapped)
        return RunRecord(steps=tuple(self.steps), checkpoints=tuple(self.checkpoints), resumes=tuple(self.resumes),
                         engine=engine, **self.fields)


def round_trip_record(rec: SaveLoadRecord, oracle: Params) -> CheckpointRoundTrip:
    """A checkpoint round trip's observation: each comparison `findings.checkpoint_judgement` may read, against
    the engine and against the oracle's parameters at that point (``oracle``)."""
    state16, fp32 = rec.get("state16"), rec.get("fp32")
    loaded = rec.get("loaded")
    counters = rec["counters"]
    master = rec.get("master")
    return CheckpointRoundTrip(
        rec["step"], None if rec.get("files") is None else tuple(rec.get("files") or ()),
        loaded if isinstance(loaded, str) or loaded is None else (str(loaded) if loaded else None), repr(loaded),
        None if state16 is None else tuple(sorted(state16)), None if fp32 is None else tuple(sorted(fp32)),
        state16_vs_engine=None if state16 is None else comparison(rec["before"], state16),
        state16_vs_oracle=None if state16 is None else comparison(oracle, state16),
        after_vs_before=comparison(rec["before"], rec.get("after", {})),
        counters_before=Counters(**counters[0]),
        counters_after=Counters(**counters[1]) if len(counters) > 1 else None,
        fp32_vs_engine=None if fp32 is None else comparison(rec["before"], fp32),
        fp32_vs_oracle=None if fp32 is None else comparison(oracle, fp32),
        fp32_exact=bool(rec.get("fp32_exact")),
        masters_restored=None if master is None else comparison(master, rec.get("master_after", {})))


__all__ = ["OnStep", "execute", "restore_torch_linear", "round_trip_record", "unrunnable", "untrainable"]
