"""Run one scenario on real DeepSpeed (inside the worker process), traced, beside the PyTorch oracle.

`execute(scenario)` returns a plain, JSON-serialisable dict (`protocol.ExecResult`):

``events``      the tracer's events (dicts of `zerostate.model.events.Event` fields);
``error``       ``"ExcType: message"`` when DeepSpeed (or torch inside it) raised, else None;
``error_check`` ``"saved-tensor-intact"`` for a torch ``CheckpointError``, ``"exception"`` otherwise;
``traceback``   the last lines of the traceback;
``mismatch``    the first oracle disagreement (``"after train step i: <param>: ..."``), else None;
``origin``      ``ExcType@module.function`` of the innermost DeepSpeed frame (distinguishes exceptions);
``frames``      every frame of the exception's traceback, ``[package, file, function, line]`` (`frames_of`);
``oracle_diff`` the first oracle disagreement's parameters, sizes and update ratios (`evidence.oracle_diff`);
``steps``       train steps compared with the oracle;
``max_diff``    the largest |DeepSpeed - PyTorch| over every parameter and compared step;
``masters_unread`` bf16: the parameters DeepSpeed's accessor gave no master copy of (its error; left out)
``masters``     bf16 only, per train step: ``[|DeepSpeed - PyTorch|, |PyTorch's update|, |DeepSpeed's update|]``
                of the fp32 master weights (`compare.master_error`); beyond `compare.MASTER_RTOL` of PyTorch's
                update (and the parameters within the tolerance) it is an oracle ``mismatch`` of kind ``master``;
``fp16``        fp16 only: ``skipped_steps`` and ``loss_scale`` of DeepSpeed's loss scaler at the end, the
                oracle's ``oracle_skipped`` (train steps skipped for an overflow), ``oracle_scales`` and
                ``oracle_scale`` (after the last step); a different number of skipped steps, or else a
                different scale at the end (the one the next step would run with), is an oracle ``mismatch``;
``skipped``     a reason when the scenario cannot be trained at all (no trainable parameter, no parameter
                in the optimizer, a loss with nothing to differentiate: `oracle.NothingToDifferentiate`)
                or not here (fp16 on a GPU accelerator without fp16 -- DeepSpeed's CPU
                accelerator is told it has fp16 for the example, `fp16.allow_fp16_on_cpu` -- or fp16 with a
                non-scalar backward, which DeepSpeed's loss scaler has no form for).
``engines_before`` one line per engine run before the scenario's own (``"ZeRO-3: ok"`` or its exception);
``carried_state`` process-wide state an earlier engine left that this engine runs with (`engine.carried_state`);
``engine``      what the built engine reports of the settings a scenario chooses (`engine.engine_settings`:
                gas, contiguous gradients, overlap_comm, ZeRO-3's all-reduce fetch, the late module; and,
                after a ZeRO-3 ``reregister`` -- TRL's unwrap for generation --, ``unwrap_gathered``: the
                parameters available while the unhooked module generated, one count per unwrap), so a
                test can tell that a scenario option reached DeepSpeed;
``save_load``    one record per checkpoint round trip (``save_load`` steps): the step, the files
                ``save_checkpoint`` wrote, the path ``load_checkpoint`` loaded, the keys of ZeRO-3's 16-bit
                state dict (None below ZeRO-3) and of the fp32 weights ``zero_to_fp32`` rebuilds (None at
                ZeRO-0);
``checkpoint``  ``[code, sentence]``: the first check of a checkpoint round trip that failed
                (`checkpoint.compare_save_load`), else absent;
``torch_linear_replaced`` True when, after the run, ``torch.nn.functional.linear`` was DeepSpeed's
                ``zero3_linear_wrap`` (a ZeRO-3 engine ran: the scenario's own or one of ``engines_before``);
                put back before the next example;
``teardown_error`` what the engine's ``destroy()`` raised, when it did.

The engine is torn down after every scenario (tracer uninstalled, ``engine.destroy()``, ZeRO-3's
module stack cleared, ``torch.nn.functional.linear`` put back (`restore_torch_linear`), a full
``gc.collect()``; see ``_RUNS``), so one worker process serves every example.  A scenario that wants
engines before its own in the process says so (``engines_before``): `engine.DeepSpeedBackend`
runs them.
"""

from __future__ import annotations

import gc
import traceback
from types import FrameType
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from zerostate.findings.evidence import frames_of
from zerostate.harness import evidence
from zerostate.harness.net import fp16
from zerostate.harness.net.checkpoint import SaveLoadRecord, compare_save_load
from zerostate.harness.net.compare import (Params, compare, compare_generated, compare_masters, compare_update,
                                           master_error, max_abs, rounding_eps, tolerance)
from zerostate.harness.net.dist import without_tmpdir
from zerostate.harness.net.engine import DeepSpeedBackend, build_engine_model, engine_settings
from zerostate.harness.net.oracle import NothingToDifferentiate, OracleInfo, oracle_params
from zerostate.harness.net.persistence import persistence_problem
from zerostate.harness.net.schedule import run_schedule
from zerostate.harness.protocol import ExecResult
from zerostate.model.scenario import BackwardKind, Family, ParamKind, Precision, Scenario
from zerostate.tracing import compat
from zerostate.tracing.tracer import Tracer

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


def _rereg_steps(sc: Scenario) -> list[int]:
    """The train steps that begin with a re-registration (TRL's unwrap), in order."""
    return [i for i, st in enumerate(sc.steps) if st.reregister]


_OWN_FRAMES = ("zerostate.harness.", "zerostate.tracing.")
"""zerostate's modules that call into DeepSpeed (the network, its loop, the executor, the tracer): where an
exception left DeepSpeed for them, `origin` names their frame as it names DeepSpeed's."""


def _frame_module(frame: FrameType) -> str | None:
    """The name `origin` gives a frame's module: DeepSpeed's by its path below ``deepspeed/``; the network's
    (``zerostate.harness.net.*``) ``net`` and zerostate's other calling modules by their last name, so a key
    does not change when the harness's files move; None for any other frame."""
    filename = frame.f_code.co_filename.replace("\\", "/")
    if "/deepspeed/" in filename:
        return filename.rsplit("/deepspeed/", 1)[1].removesuffix(".py").replace("/", ".")
    module = str(frame.f_globals.get("__name__", ""))
    if module.startswith("zerostate.harness.net."):
        return "net"
    if module.startswith(_OWN_FRAMES):
        return module.rsplit(".", 1)[1]
    return None


def origin(exc: BaseException) -> str:
    """Where an exception was raised, stable across releases and across moves of zerostate's files:
    ``ExcType@module.function`` of the innermost frame of DeepSpeed or of zerostate's code that calls it
    (`_frame_module`), else of the innermost frame."""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    pick = None
    for frame in frames:
        module = _frame_module(frame)
        if module is not None:
            pick = (module, frame.f_code.co_name)
    if pick is None and frames:
        code = frames[-1].f_code
        pick = (code.co_filename.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py"), code.co_name)
    return f"{type(exc).__name__}@{pick[0]}.{pick[1]}" if pick else type(exc).__name__


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


def _empty_result() -> ExecResult:
    return {"events": [], "error": None, "error_check": None, "traceback": None, "mismatch": None, "steps": 0}


def execute(sc: Scenario, on_step: OnStep | None = None) -> ExecResult:
    """Run ``sc`` on the engine, traced, beside the oracle.  ``on_step(i, params)``: called after train step
    ``i`` with the gathered parameters (the rank pool reports checksums to the parent after every step)."""
    res = _empty_result()
    reason = untrainable(sc)
    if reason:
        res["skipped"] = reason
        return res
    reason = unrunnable(sc)
    if reason:
        fp16.restore_fp16_support()
        res["skipped"] = reason
        return res
    try:
        oracle_info: OracleInfo = {}
        expected = oracle_params(sc, oracle_info)
    except NothingToDifferentiate as exc:  # neither side can train it (measured on DeepSpeed 0.19.8)
        res["skipped"] = str(exc)
        return res
    except Exception as exc:  # noqa: BLE001 -- the oracle itself failed: zerostate's error, reported as such
        res["error"] = f"oracle: {type(exc).__name__}: {exc}"
        res["error_check"] = "oracle-error"
        res["traceback"] = "".join(traceback.format_exc().splitlines(True)[-8:])
        return res
    backend: DeepSpeedBackend | None = None
    tracer: Tracer | None = None
    model = None
    tol = tolerance(sc)
    try:
        model = build_engine_model(sc)
        built_partitioned = sum(isinstance(p, _ZeroInitParam) for p in model.parameters())  # zero_init: by zero.Init
        backend = built = DeepSpeedBackend(sc, model)
        if built.engines_before:
            res["engines_before"] = built.engines_before
        if built.carried:
            res["carried_state"] = built.carried
        if sc.stage == 3:
            persistence = persistence_problem(built.engine.module, sc.persistence_threshold)
            if persistence:
                res["persistence"] = persistence
        settings = engine_settings(built.engine)
        settings["built_partitioned"] = built_partitioned  # parameters zero.Init had partitioned before
        res["engine"] = dict(settings)
        eps = rounding_eps(sc)
        initial_ds = built.params() if eps else None  # mixed precision: the update's norm (compare_update)
        masters0 = built.masters() if sc.precision is Precision.BF16 else None  # bf16: compare_masters
        started: dict[str, Any] = {"pt": oracle_info["initial"], "ds": initial_ds or oracle_info["initial"],
                                   "pt_earlier": None, "ds_masters": masters0}  # where each step started, both sides
        tracer = traced = Tracer(built.engine, sc).install()

        def after_step(i: int) -> None:
            with traced.paused():
                got = built.params()
                got_masters = built.masters() if masters0 is not None else None
            if got_masters is not None:
                res.setdefault("masters", []).append(list(master_error(oracle_info["initial"], expected[i],
                                                                       got_masters)))
            res["steps"] = i + 1
            res["max_diff"] = max(res.get("max_diff", 0.0), max(
                (max_abs(got[n].float() - e.float()) for n, e in expected[i].items()
                 if n in got and got[n].shape == e.shape), default=0.0))
            if res["mismatch"] is None:  # the generations so far (TRL's unwrap) came before this step's parameters
                gen = compare_generated(oracle_info["generated"][:len(built.generated)], built.generated, *tol)
                if gen is not None:
                    res["mismatch"] = (f"generation before train step {_rereg_steps(sc)[gen[0]]} (TRL's unwrap): "
                                       f"{gen[1]}")
                    res["oracle_diff"] = evidence.oracle_diff("generation", i)
            msg = compare(expected[i], got, *tol)
            kind = "params"
            if not msg and eps and initial_ds is not None:
                msg, kind = compare_update(oracle_info["initial"], expected[i], initial_ds, got, eps), "update-norm"
            atol, rtol, ds_now, ds_start = *tol, got, started["ds"]
            if not msg and got_masters is not None and started["ds_masters"] is not None:
                msg, atol = compare_masters(oracle_info["initial"], expected[i], got_masters, sc.world_size)
                kind, rtol, ds_now, ds_start = "master", 0.0, got_masters, started["ds_masters"]
            if msg and res["mismatch"] is None:
                res["mismatch"] = f"after train step {i}: {msg}"
                cfs = oracle_info.get("counterfactuals") or []
                res["oracle_diff"] = evidence.oracle_diff(kind, i, expected[i], ds_now, started["pt"], ds_start,
                                                          atol, rtol, pt_earlier=started["pt_earlier"],
                                                          counterfactuals=cfs[i] if i < len(cfs) else None)
            started.update(pt_earlier=started["pt"], pt=expected[i], ds=got, ds_masters=got_masters)
            if on_step is not None:
                on_step(i, got)

        def mark(what: str, **info: object) -> None:
            traced.mark(what, **info)
            if what == "save_load_end":
                step, record = info["step"], info["record"]
                assert isinstance(step, int) and isinstance(record, dict)
                save_load_done(step, record)  # type: ignore[arg-type]

        def save_load_done(i: int, rec: SaveLoadRecord) -> None:
            res.setdefault("save_load", []).append(
                {"step": i, "files": rec.get("files"), "loaded": rec.get("loaded"),
                 "state16": None if "state16" not in rec else sorted(rec["state16"]),
                 "fp32": None if "fp32" not in rec else sorted(rec["fp32"])})
            before = None if res["mismatch"] else expected[i - 1] if i else oracle_info["initial"]
            failed = compare_save_load(rec, before, tol)
            if failed and "checkpoint" not in res:
                res["checkpoint"] = list(failed)

        try:
            run_schedule(sc, built, mark=mark, after_step=after_step)
        finally:
            if built.masters_unread:  # parameters left out of the master-weight comparison, and why
                res["masters_unread"] = dict(built.masters_unread)
        if built.unwrapped:
            res["engine"]["unwrap_gathered"] = built.unwrapped
        state = built.fp16_state()
        if state is not None:  # the loss scaler: the steps skipped for an overflow and the scale, both sides
            skipped = oracle_info.get("skipped", [])
            final = oracle_info.get("scale")
            res["fp16"] = {**state, "oracle_skipped": oracle_info.get("skipped"),
                           "oracle_scales": oracle_info.get("scales"), "oracle_scale": final}
            if res["mismatch"] is None and state["skipped_steps"] != len(skipped):
                res["oracle_diff"] = evidence.oracle_diff("loss-scaling", None)
                res["mismatch"] = (f"loss scaling: DeepSpeed skipped {state['skipped_steps']} step(s) for an overflow, "
                                   f"PyTorch's loss scaler {len(skipped)} (steps "
                                   f"{oracle_info.get('skipped')}, scales {oracle_info.get('scales')})")
            elif res["mismatch"] is None and final is not None and state["loss_scale"] != final:
                # same steps skipped, yet the scale the next step would run with differs: the scaler's update
                res["oracle_diff"] = evidence.oracle_diff("loss-scaling", None)
                res["mismatch"] = (f"loss scaling: DeepSpeed's loss scale after the last step is "
                                   f"{state['loss_scale']:g}, PyTorch's loss scaler's {final:g} (both skipped steps "
                                   f"{oracle_info.get('skipped')}; the scales the steps ran with "
                                   f"{oracle_info.get('scales')})")
    except Exception as exc:  # noqa: BLE001 -- whatever DeepSpeed (or torch inside it) raised is the finding
        res["error"] = without_tmpdir(f"{type(exc).__name__}: {exc}")
        res["error_check"] = "saved-tensor-intact" if compat.is_checkpoint_error(exc) else "exception"
        res["traceback"] = "".join(traceback.format_exc().splitlines(True)[-12:])
        res["origin"] = origin(exc)
        res["frames"] = frames_of(exc)
    finally:
        if tracer is not None:
            res["events"] = tracer.events
            tracer.uninstall()
        if backend is not None:
            teardown = backend.close()
            if teardown:
                res["teardown_error"] = teardown
        compat.clear_globals()
        fp16.restore_fp16_support()  # fp16 on the CPU accelerator: for this example only
        if restore_torch_linear():  # a ZeRO-3 engine (this scenario's, or one of its engines_before) ran
            res["torch_linear_replaced"] = True
        del backend, tracer, model
        _RUNS[0] += 1
        gc.collect()
        gc.freeze()
    return res


__all__ = ["OnStep", "execute", "origin", "restore_torch_linear", "unrunnable", "untrainable"]
