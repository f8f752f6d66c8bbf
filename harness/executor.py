"""Run one scenario on real DeepSpeed (inside the worker process), traced, beside the PyTorch oracle.

`execute(spec)` returns a plain, JSON-serialisable dict:

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
``fp16``        fp16 only: ``skipped_steps`` and ``loss_scale`` of DeepSpeed's loss scaler at the end, the
                oracle's ``oracle_skipped`` (train steps skipped for an overflow) and ``oracle_scales``;
                a different number of skipped steps is an oracle ``mismatch``;
``skipped``     a reason when the scenario cannot be trained at all (no trainable parameter, no parameter
                in the optimizer) or not here (fp16 on a GPU accelerator without fp16 -- DeepSpeed's CPU
                accelerator is told it has fp16 for the example, `net.allow_fp16_on_cpu` -- or fp16 with a
                non-scalar backward, which DeepSpeed's loss scaler has no form for).
``engines_before`` one line per engine run before the scenario's own (``"ZeRO-3: ok"`` or its exception);
``carried_state`` process-wide state an earlier engine left that this engine runs with (`net.carried_state`);
``engine``      what the built engine reports of the settings a scenario chooses (`net.engine_settings`:
                gas, contiguous gradients, overlap_comm, ZeRO-3's all-reduce fetch, the late module; and,
                after a ZeRO-3 ``reregister`` -- TRL's unwrap for generation --, ``unwrap_gathered``: the
                parameters available while the unhooked module generated, one count per unwrap), so a
                test can tell that a scenario option reached DeepSpeed;
``save_load``    one record per checkpoint round trip (``save_load`` steps): the step, the files
                ``save_checkpoint`` wrote, the path ``load_checkpoint`` loaded, the keys of ZeRO-3's 16-bit
                state dict (None below ZeRO-3) and of the fp32 weights ``zero_to_fp32`` rebuilds (None at
                ZeRO-0);
``checkpoint``  ``[code, sentence]``: the first check of a checkpoint round trip that failed
                (`net.compare_save_load`), else absent;
``torch_linear_replaced`` True when, after the run, ``torch.nn.functional.linear`` was DeepSpeed's
                ``zero3_linear_wrap`` (a ZeRO-3 engine ran: the scenario's own or one of ``engines_before``);
                put back before the next example.

The engine is torn down after every scenario (tracer uninstalled, ``engine.destroy()``, ZeRO-3's
module stack cleared, ``torch.nn.functional.linear`` put back (`restore_torch_linear`), a full
``gc.collect()``; see ``_RUNS``), so one worker process serves every example.  A scenario that wants
engines before its own in the process says so (``engines_before``, issue 15): `net.DeepSpeedBackend`
runs them.
"""

from __future__ import annotations

import gc
import traceback

import torch

from zerostate.findings.evidence import frames_of
from zerostate.tracing import compat
from zerostate.harness import evidence, net
from zerostate.tracing.tracer import Tracer

_TORCH_LINEAR = torch.nn.functional.linear
"""torch's own ``F.linear``, taken when the worker imports this module (before any engine).  A ZeRO-3
engine replaces ``torch.nn.functional.linear`` process-wide by DeepSpeed's ``zero3_linear_wrap`` and
never puts it back (known issue ``z3-linear-override-outlives-engine``), so every later example -- its
oracle and its engine, ZeRO-1/2 included -- would run each ``nn.Linear`` through
``LinearFunctionForZeroStage3``: the gradient-hook order changes, and with it which check a finding
hits (an order-dependent finding on 0.19.8).  The worker restores it after every example, so examples
stay independent; ``engines_before`` makes the carried state a scenario dimension instead."""


def restore_torch_linear() -> bool:
    """Put torch's ``F.linear`` back if DeepSpeed replaced it; True when it had."""
    orig = _TORCH_LINEAR
    if "deepspeed" in getattr(orig, "__module__", ""):  # imported after an engine already replaced it
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as cls
        orig = getattr(cls, "linear_bk", orig)
    if torch.nn.functional.linear is orig:
        return False
    torch.nn.functional.linear = orig
    return True

_RUNS = [0]
"""Examples run by this worker.  After every example the worker runs a full collection -- so each example
starts from the same state, whatever ran before: no engine of an earlier example lingers in a reference
cycle with hooks still attached -- and then ``gc.freeze()``s what survives it.  The next example's
collections (this one, and the ones DeepSpeed makes itself: ``defragment``, ``empty_cache``) then scan
only that example's own objects.  Freezing only after the first example left whatever a later example
imported first (transformers' and PEFT's modules, with the first llama example) to be scanned by every
later collection: 3.1 s of 8.7 s over the explorer's first 55 world-size-1 examples went to
``gc.collect`` (0.044 s a call, measured on 0.19.8, 1 Dec).  What is frozen was alive after a full
collection; an object of it that becomes garbage later is not reclaimed (a few module-level caches, not
engines: those are collected before the freeze)."""


def _rereg_steps(spec: dict) -> list[int]:
    """The train steps that begin with a re-registration (TRL's unwrap), in order."""
    return [i for i, st in enumerate(spec.get("steps", [{}])) if st.get("reregister", False)]


def origin(exc: BaseException) -> str:
    """Where an exception was raised, stable across releases: ``ExcType@module.function`` of the
    innermost DeepSpeed frame (else the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    pick = None
    for fr in frames:
        norm = fr.filename.replace("\\", "/")
        if "/deepspeed/" in norm:
            pick = (norm.rsplit("/deepspeed/", 1)[1].removesuffix(".py").replace("/", "."), fr.name)
    if pick is None and frames:
        fr = frames[-1]
        pick = (fr.filename.rsplit("/", 1)[-1].removesuffix(".py"), fr.name)
    return f"{type(exc).__name__}@{pick[0]}.{pick[1]}" if pick else type(exc).__name__


def unrunnable(spec: dict) -> str | None:
    """Why this scenario cannot run here, or None."""
    if spec.get("precision") == "fp16":
        from deepspeed.accelerator import get_accelerator
        net.allow_fp16_on_cpu()  # DeepSpeed's CPU accelerator is told fp16 is supported (torch computes it)
        acc = get_accelerator()
        if not acc.is_fp16_supported():
            return f"fp16 is not supported by DeepSpeed's {acc.device_name()} accelerator on this machine"
        if any(m.get("backward") == "nonscalar" for s in spec.get("steps", [{}]) for m in s.get("micro", [{}])):
            return ("fp16 with a non-scalar backward: DeepSpeed requires the loss scaler on every backward "
                    "(engine.backward(loss) or engine.scale(loss).backward(), engine.py _backward_post_hook) and "
                    "engine.scale takes a scalar loss, so a non-scalar backward has no fp16 form to test")
    if spec.get("family", "blocks") == "blocks" and not spec.get("fused_head", False) and all(
            not b.get("in_optimizer", True) or all(b.get(k, "trainable") == "frozen" for k in ("norm", "lin"))
            for b in spec.get("blocks", [{}])):
        return "no parameter in any optimizer group: neither PyTorch nor DeepSpeed can build the optimizer"
    return None


def execute(spec: dict, on_step=None) -> dict:
    """``on_step(i, params)``: called after train step ``i`` with the gathered parameters (the rank pool
    reports checksums to the parent after every step)."""
    res: dict = {"events": [], "error": None, "error_check": None, "traceback": None, "mismatch": None,
                 "steps": 0}
    if not any(b.get(k, "trainable") != "frozen" for b in spec.get("blocks", [{}]) for k in ("norm", "lin")) \
            and not spec.get("fused_head", False):
        res["skipped"] = "no trainable parameter: neither PyTorch nor DeepSpeed can build the optimizer"
        return res
    reason = unrunnable(spec)
    if reason:
        net.restore_fp16_support()
        res["skipped"] = reason
        return res
    try:
        oracle_fp16: dict = {}
        expected = net.oracle_params(spec, oracle_fp16)
    except Exception as exc:  # the oracle itself failed: the scenario is not trainable in plain PyTorch
        res.update(error=f"oracle: {type(exc).__name__}: {exc}", error_check="oracle-error",
                   traceback="".join(traceback.format_exc().splitlines(True)[-8:]))
        return res
    backend = tracer = model = None
    try:
        model = net.build_engine_model(spec)
        built_partitioned = sum(hasattr(p, "ds_id") for p in model.parameters())  # zero_init: by zero.Init
        backend = net.DeepSpeedBackend(spec, model)
        if backend.engines_before:
            res["engines_before"] = backend.engines_before
        if backend.carried:
            res["carried_state"] = backend.carried
        res["engine"] = net.engine_settings(backend.engine)
        res["engine"]["built_partitioned"] = built_partitioned  # parameters zero.Init had partitioned before
        eps = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}.get(spec.get("precision", "fp32"))
        initial_ds = backend.params() if eps else None  # mixed precision: the update's norm (compare_update)
        before = {"pt": oracle_fp16["initial"], "ds": initial_ds or oracle_fp16["initial"], "pt_earlier": None}
        tracer = Tracer(backend.engine, spec).install()

        def after_step(i: int) -> None:
            with tracer.paused():
                got = backend.params()
            res["steps"] = i + 1
            res["max_diff"] = max(res.get("max_diff", 0.0), max(
                (net.max_abs(got[n].float() - e.float()) for n, e in expected[i].items()
                 if n in got and got[n].shape == e.shape), default=0.0))
            if res["mismatch"] is None:  # the generations so far (TRL's unwrap) came before this step's parameters
                gen = net.compare_generated(oracle_fp16["generated"][:len(backend.generated)], backend.generated,
                                            *net.tolerance(spec))
                if gen is not None:
                    res["mismatch"] = f"generation before train step {_rereg_steps(spec)[gen[0]]} (TRL's unwrap): {gen[1]}"
                    res["oracle_diff"] = evidence.oracle_diff("generation", i)
            msg = net.compare(expected[i], got, *net.tolerance(spec))
            kind = "params"
            if not msg and eps:
                msg, kind = net.compare_update(oracle_fp16["initial"], expected[i], initial_ds, got, eps), "update-norm"
            if msg and res["mismatch"] is None:
                res["mismatch"] = f"after train step {i}: {msg}"
                res["oracle_diff"] = evidence.oracle_diff(kind, i, expected[i], got, before["pt"], before["ds"],
                                                          *net.tolerance(spec), pt_earlier=before["pt_earlier"])
            before.update(pt_earlier=before["pt"], pt=expected[i], ds=got)  # where each step started
            if on_step is not None:
                on_step(i, got)

        def mark(what: str, **info) -> None:
            tracer.mark(what, **info)
            if what == "save_load_end":
                save_load_done(info["step"], info["record"])

        def save_load_done(i: int, rec: dict) -> None:
            res.setdefault("save_load", []).append(
                {"step": i, "files": rec.get("files"), "loaded": rec.get("loaded"),
                 "state16": None if "state16" not in rec else sorted(rec["state16"]),
                 "fp32": None if "fp32" not in rec else sorted(rec["fp32"])})
            before = None if res["mismatch"] else expected[i - 1] if i else oracle_fp16["initial"]
            failed = net.compare_save_load(rec, before, net.tolerance(spec))
            if failed and "checkpoint" not in res:
                res["checkpoint"] = list(failed)

        net.run_schedule(spec, backend, mark=mark, after_step=after_step)
        if backend.unwrapped:
            res["engine"]["unwrap_gathered"] = backend.unwrapped
        fp16 = backend.fp16_state()
        if fp16 is not None:  # the loss scaler: the steps skipped for an overflow and the scale, both sides
            fp16.update(oracle_skipped=oracle_fp16.get("skipped"), oracle_scales=oracle_fp16.get("scales"))
            res["fp16"] = fp16
            if res["mismatch"] is None and (fp16["skipped_steps"] != len(oracle_fp16["skipped"])):
                res["oracle_diff"] = evidence.oracle_diff("loss-scaling", None)
                res["mismatch"] = (f"loss scaling: DeepSpeed skipped {fp16['skipped_steps']} step(s) for an overflow, "
                                   f"PyTorch's loss scaler {len(oracle_fp16['skipped'])} (steps "
                                   f"{oracle_fp16['skipped']}, scales {oracle_fp16['scales']})")
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["error_check"] = "saved-tensor-intact" if compat.is_checkpoint_error(exc) else "exception"
        res["traceback"] = "".join(traceback.format_exc().splitlines(True)[-12:])
        res["origin"] = origin(exc)
        res["frames"] = frames_of(exc)
    finally:
        if tracer is not None:
            res["events"] = tracer.events
            tracer.uninstall()
        if backend is not None:
            backend.close()
        compat.clear_globals()
        net.restore_fp16_support()  # fp16 on the CPU accelerator: for this example only
        if restore_torch_linear():  # a ZeRO-3 engine (this scenario's, or one of its engines_before) ran
            res["torch_linear_replaced"] = True
        del backend, tracer, model
        _RUNS[0] += 1
        gc.collect()
        gc.freeze()
    return res
