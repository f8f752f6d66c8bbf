"""The real engine as the loop's backend (`DeepSpeedBackend`): ``deepspeed.initialize`` with ZeRO 0-3 and a
client SGD (or, ``config-adam``, the optimizer DeepSpeed builds from the config over the same groups), the
model built as HF's ``from_pretrained`` builds it under ZeRO-3 (`build_zero_init`), the engines a scenario
runs before its own (`run_engines_before`), and what the built engine reports (`engine_settings`)."""

from __future__ import annotations

import types
from dataclasses import replace
from enum import Enum
from collections.abc import Callable
from typing import Any, Protocol, TypedDict, runtime_checkable

import torch
import torch.nn as nn

from zerostate.findings.record import EngineSettings, GroupSettings, OptimizerBuilt
from zerostate.harness.net import fp16
from zerostate.harness.net.checkpoint import Counters, ResumeRecord, SaveLoadRecord, round_trip, shared_checkpoint_dir
from zerostate.harness.net.compare import Params
from zerostate.harness.net.config import LR, ds_config, make_scheduler, param_groups
from zerostate.harness.net.dist import barrier, rank_rows
from zerostate.harness.net.llama import apply_lora
from zerostate.harness.net.torch_network import NetOutput, attach_late_module, blocks_of, build_model
from zerostate.harness.net.schedule import generation_output, no_grad_forward, run_schedule
from zerostate.model.scenario import (BackwardKind, Family, Gather, MicroStep, Offload, Optimizer, Precision,
                                      Scenario, Scheduler, TrainStep)


@runtime_checkable
class _ZeroParam(Protocol):
    """A ZeRO-3 parameter."""

    ds_tensor: torch.Tensor
    ds_status: Enum


def _zero_status(p: object) -> str | None:
    """A ZeRO-3 parameter's status (``AVAILABLE``, ``NOT_AVAILABLE``, ``INFLIGHT``); None for any other."""
    return p.ds_status.name if isinstance(p, _ZeroParam) else None


@runtime_checkable
class _Held(Protocol):
    """A ZeRO-3 parameter's holders (the modules that fetched it and have not released it)."""

    ds_active_sub_modules: set[int]


@runtime_checkable
class _Gatherable(Protocol):
    """A ZeRO-3 parameter's bound all-gather (a closure that captured the ``zero.Init`` converting it)."""

    all_gather_coalesced: Callable[..., Any]


@runtime_checkable
class _ZeroInitFlags(Protocol):
    use_all_reduce_for_fetch_params: bool


@runtime_checkable
class _Offloading(Protocol):
    """ZeRO-3's optimizer: its ``DeepSpeedZeRoOffload`` holds the module hooks."""

    parameter_offload: Any


@runtime_checkable
class _LossScaled(Protocol):
    """An fp16 optimizer with a loss scaler."""

    loss_scale: float


@runtime_checkable
class _Destroyable(Protocol):
    def destroy(self) -> None: ...


class Fp16State(TypedDict):
    skipped_steps: int
    loss_scale: float


def optimizer_built(engine: Any) -> OptimizerBuilt:
    """Which optimizer the engine holds under its ZeRO / precision wrapper (``engine.basic_optimizer``), and
    whether DeepSpeed built it from the config (no client optimizer was passed)."""
    opt = engine.basic_optimizer
    return OptimizerBuilt(f"{type(opt).__module__}.{type(opt).__name__}" if opt is not None else None,
                          engine.client_optimizer is None,
                          tuple(_group_settings(g) for g in (opt.param_groups if opt is not None else [])))


def _group_settings(group: dict[str, Any]) -> GroupSettings:
    def num(key: str) -> float | None:
        return None if group.get(key) is None else float(group[key])
    betas = group.get("betas")
    return GroupSettings(num("lr"), num("eps"), None if betas is None else tuple(float(b) for b in betas),
                         num("weight_decay"))


def _closure_cells(fn: object) -> list[object]:
    """The values a function (or a bound method's function) closed over."""
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    closure = fn.__closure__ if isinstance(fn, types.FunctionType) else None
    return [c.cell_contents for c in closure or ()]


def _all_reduce_fetch(module: nn.Module) -> bool | None:
    """ZeRO-3's all-reduce fetch flag of the ``zero.Init`` that converted the parameters (held by each
    parameter's bound ``all_gather_coalesced``, inside DeepSpeed's instrument_w_nvtx wrapper); None if absent."""
    p = next(iter(module.parameters()), None)
    fns: list[object] = [p.all_gather_coalesced] if isinstance(p, _Gatherable) else []
    for _ in range(3):
        cells = [c for fn in fns for c in _closure_cells(fn)]
        init = next((c for c in cells if isinstance(c, _ZeroInitFlags)), None)
        if init is not None:
            return init.use_all_reduce_for_fetch_params
        fns = [c for c in cells if callable(c)]
    return None


def engine_settings(engine: Any, built_partitioned: int = 0) -> EngineSettings:
    """What the engine itself reports of the settings a scenario chooses: DeepSpeed's own accessors, and ZeRO-3's
    all-reduce fetch (`_all_reduce_fetch`); ``built_partitioned``: the parameters ``zero.Init`` had partitioned."""
    return EngineSettings(int(engine.gradient_accumulation_steps()), bool(engine.zero_contiguous_gradients()),
                          bool(engine.zero_overlap_comm()), bool(engine.zero_reduce_scatter()),
                          "late" in engine.module._modules, int(engine.world_size), optimizer_built(engine),
                          _all_reduce_fetch(engine.module), built_partitioned)


def build_engine_model(sc: Scenario) -> nn.Module:
    """The network DeepSpeed trains: `build_model`'s, or with ``zero_init`` (ZeRO-3) built the way Hugging
    Face's ``from_pretrained`` builds it when ZeRO-3 is configured (`build_zero_init`)."""
    if sc.zero_init and sc.stage == 3:
        return build_zero_init(sc)
    return build_model(sc)


def build_zero_init(sc: Scenario) -> nn.Module:
    """HF ``from_pretrained`` under ZeRO-3 (``HfDeepSpeedConfig`` / accelerate's ``zero3_init_flag``): the
    modules are constructed inside ``deepspeed.zero.Init(config_dict_or_path=config)`` -- no ``dtype``, as HF
    passes none: the config's bf16/fp16 decides it (an explicit ``dtype`` is ignored on an accelerator
    without fp16, such as the CPU one: ``_set_dtype``'s ``dtype or torch.float16 if ... else torch.bfloat16``
    parses as ``(dtype or fp16) if fp16_supported else bf16``) -- so each parameter is partitioned (and cast)
    as it is made; the weights are then loaded into the partitioned parameters under
    ``GatheredParameters(modifier_rank=0)``; PEFT's LoRA wraps the model afterwards, so its adapters are made
    outside ``zero.Init`` and stay fp32 (PEFT's ``autocast_adapter_dtype``) while the base is bf16/fp16 -- the
    mix of DeepSpeed #8072/#8073.  The values are `build_model`'s (the oracle's)."""
    import deepspeed
    ref = dict(build_model(sc).named_parameters())
    with deepspeed.zero.Init(config_dict_or_path=ds_config(sc)):
        model = build_model(replace(sc, lora=False, modules_to_save=False))
    model = apply_lora(sc, model)
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            p.data.copy_(ref[name].data)
    model.train()
    return model


def engine_before_scenario(sc: Scenario, stage: int) -> Scenario:
    """The scenario of an engine that runs before the scenario's own (``engines_before``): the same network
    (z3 leaf flags cleared) and setup with ZeRO ``stage``, one plain train step of ``gas`` engine.backward
    calls, no engines before it.  Not validated: ZeRO-3 options stay set and mean nothing below ZeRO-3."""
    offload = sc.offload
    if stage != 3 and offload in (Offload.PARAM, Offload.BOTH):
        offload = Offload.OPTIMIZER if offload is Offload.BOTH else Offload.NONE
    return replace(sc, engines_before=(), stage=stage, offload=offload,
                   blocks=tuple(replace(b, leaf=False) for b in sc.blocks),
                   steps=(TrainStep(micro=tuple(MicroStep(backward=BackwardKind.ENGINE) for _ in range(sc.gas))),))


def run_engines_before(sc: Scenario) -> list[str]:
    """Build, train one plain step and destroy one engine per stage of ``engines_before``, in order, in this
    process.  Returns one line per engine: ``"ZeRO-k: ok"`` or ``"ZeRO-k: ExcType: message"`` -- an engine
    before that raises is part of the process's history like any other (its own bug is found when its
    scenario is explored as the main one), so the next engine still runs."""
    done = []
    for stage in sc.engines_before:
        sub = engine_before_scenario(sc, stage)
        backend = None
        try:
            backend = DeepSpeedBackend(sub, build_engine_model(sub))
            run_schedule(sub, backend)
            done.append(f"ZeRO-{stage}: ok")
        except Exception as exc:  # noqa: BLE001 -- whatever DeepSpeed raised is this engine's line
            done.append(f"ZeRO-{stage}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        finally:
            if backend is not None:
                backend.close()
    return done


def linear_in_use() -> str:
    """``module.name`` of the ``torch.nn.functional.linear`` an engine runs with: DeepSpeed's ``zero3_linear_wrap``
    when a ZeRO-3 engine replaced it (partition_parameters.py ``_enable_mem_efficient_linear``) and ``destroy()``
    did not put it back."""
    fn = torch.nn.functional.linear
    return f"{fn.__module__ or ''}.{getattr(fn, '__name__', '')}"


def stage0_masters(module: nn.Module, optimizer: Any) -> Params:
    """ZeRO-0 mixed precision: each parameter's fp32 master, from the optimizer wrapper's own groups:
    ``FP16_Optimizer`` keeps one flat fp32 tensor per group over the group's trainable 16-bit parameters in
    order (``fp16_groups``, ``fp32_groups_flat``), ``FP16_UnfusedOptimizer`` one fp32 parameter per 16-bit one
    (``fp32_groups``).  Empty for any other optimizer."""
    names = {id(p): n for n, p in module.named_parameters()}
    fp16_groups = getattr(optimizer, "fp16_groups", None)
    flat = getattr(optimizer, "fp32_groups_flat", None)
    per_param = getattr(optimizer, "fp32_groups", None)
    out: Params = {}
    if not isinstance(fp16_groups, list):
        return out
    for i, group in enumerate(fp16_groups):
        if isinstance(flat, list) and i < len(flat):
            from torch._utils import _unflatten_dense_tensors
            masters = _unflatten_dense_tensors(flat[i].detach(), group)
        elif isinstance(per_param, list) and i < len(per_param):
            masters = per_param[i]
        else:
            continue
        for p, m in zip(group, masters, strict=False):
            if id(p) in names:
                out[names[id(p)]] = m.detach().float().cpu().clone()
    return out


class DeepSpeedBackend:
    """The engine's `schedule.Backend`.  With ``engines_before`` in the scenario, those engines run first."""

    def __init__(self, sc: Scenario, model: nn.Module) -> None:
        self.sc = sc
        self.stage = sc.stage
        if sc.precision is Precision.FP16:
            fp16.allow_fp16_on_cpu()
        self.engines_before = run_engines_before(sc)
        self.torch_linear = linear_in_use()
        self.engine: Any
        self.user_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        """``scheduler: user``: the loop's own schedule over its client optimizer (`lr_step`)."""
        self._initialize(model)
        self.names = {id(p): n for n, p in self.engine.module.named_parameters()}
        self.llama = sc.family is Family.LLAMA
        self.dtype = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(sc.precision)
        self.fp32 = self.dtype is None
        self.unwrapped: list[int] = []
        """Per ``reregister`` (TRL's unwrap for generation): the parameters available while generating."""
        self.masters_unread: dict[str, str] = {}
        """`masters`: the parameters whose master copy DeepSpeed's accessor could not give, and its error."""
        self.reads: list[torch.Tensor] = []
        """Per ``gather: read``: every parameter as read in the context, flattened one after another."""
        self.generated: list[torch.Tensor] = []
        """Per ``reregister``: what the unhooked module generated (compared with the oracle's)."""
        self.manual = sc.manual_boundary
        self.share = 1.0 / sc.gas if self.manual else 1.0
        """``manual_boundary``: the engine's gradient_accumulation_steps is 1, so the loop divides each loss
        by ``gas`` itself (what the engine does at gas > 1)."""

    def _initialize(self, model: nn.Module) -> None:
        """``deepspeed.initialize`` of ``model`` with the scenario's config, client optimizer and scheduler (z3 leaf
        modules marked first, a late module attached after)."""
        import deepspeed
        sc = self.sc
        if sc.stage == 3:
            from deepspeed.utils import set_z3_leaf_module
            for i, b in enumerate(sc.blocks):
                if b.leaf:
                    set_z3_leaf_module(blocks_of(model).block(i), True)
        handed = sc.scheduler is Scheduler.INITIALIZE
        if sc.optimizer is Optimizer.CONFIG_ADAM:  # DeepSpeed builds it from the config, over these groups
            # a scheduler is a callable of the optimizer DeepSpeed builds, as HF Trainer passes it
            self.engine, self.opt, _, _ = deepspeed.initialize(
                model=model, model_parameters=param_groups(sc, model), config=ds_config(sc),
                lr_scheduler=(lambda built: make_scheduler(sc, built)) if handed else None)
        else:
            opt = torch.optim.SGD(param_groups(sc, model), lr=LR)  # type: ignore[arg-type]
            scheduler = make_scheduler(sc, opt)
            self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(sc),
                                                               lr_scheduler=scheduler if handed else None)
            self.user_scheduler = None if handed else scheduler
        if sc.precision is Precision.FP16:
            engine = self.engine
            fp16.set_loss_scale(lambda: float(engine.optimizer.loss_scale))
        attach_late_module(sc, self.engine.module)

    def module(self) -> nn.Module:
        module: nn.Module = self.engine.module
        return module

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        x = rank_rows(x)
        if self.dtype is not None and x.is_floating_point():  # the engine casts the module, not its input
            x = x.detach().to(self.dtype).requires_grad_(x.requires_grad)
        if x.device != self.engine.device:
            x = x.detach().to(self.engine.device).requires_grad_(x.requires_grad)
        return x

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> NetOutput:
        x = self._input(x)
        if self.llama:
            return self.engine(input_ids=x, labels=x)
        return self.engine(x, skip=tuple(skip)) if skip else self.engine(x)

    def reregister(self, x: torch.Tensor | None = None) -> None:
        """TRL's ``unwrap_model_for_generation`` at ZeRO-3 (``gather_deepspeed3_params``, its default): every
        parameter gathered (``GatheredParameters``), ZeRO-3's module hooks removed (``remove_hooks``), the
        unwrapped module generating -- here one no-grad forward of ``x`` in eval mode, without hooks --, the
        hooks registered again (``add_hooks``), the parameters released when the gather ends."""
        if not isinstance(self.engine.optimizer, _Offloading):
            return
        off = self.engine.optimizer.parameter_offload
        if off is None:
            return
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(self.engine.module.parameters())):
            for p in self.engine.module.parameters():
                if isinstance(p, _Held):
                    p.ds_active_sub_modules.clear()
            for h in off.forward_hooks + off.backward_hooks:
                h.remove()
            off.forward_hooks, off.backward_hooks = [], []
            if x is not None:
                self._generate(x)
            off._register_deepspeed_module(off.module)

    def gather(self, what: Gather, block: int | None) -> None:
        """The loop's own ``GatheredParameters`` (`Gather`; at ZeRO-1/2 and stage 0 the context does nothing).  A
        read: every parameter gathered at once and read (TRL's weight sync, ``GatheredParameters(model.parameters())``).
        An edit: block ``block``'s Linear weight halved under ``GatheredParameters(modifier_rank=0)`` on every rank
        (rank 0's is broadcast), then its fp32 master halved with ``safe_set_full_fp32_param`` where DeepSpeed keeps
        one (at ZeRO-3 ``safe_get_full_fp32_param`` is a collective every rank calls): what DeepSpeed answers a user
        who changes a parameter in training (deepspeedai/DeepSpeed#2424)."""
        import deepspeed
        module = self.engine.module
        if what is Gather.READ:
            params = list(module.parameters())
            with deepspeed.zero.GatheredParameters(params):
                self.reads.append(torch.cat([p.detach().float().flatten().cpu() for p in params]))
            return
        if what is not Gather.EDIT or block is None:
            return
        from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
        w = blocks_of(module).block(block).lin.weight
        with deepspeed.zero.GatheredParameters([w], modifier_rank=0), torch.no_grad():
            w.mul_(0.5)
        master = safe_get_full_fp32_param(w)
        if master is not None:
            safe_set_full_fp32_param(w, master * 0.5)

    def _generate(self, x: torch.Tensor) -> None:
        module = self.engine.module
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        self.unwrapped.append(sum(_zero_status(p) == ZeroParamStatus.AVAILABLE.name
                                  for p in module.parameters()))  # gathered while generating (the executor reports it)
        self.generated.append(generation_output(no_grad_forward(module, self._input(x), self.llama)).float())

    def eval_forward(self, x: torch.Tensor) -> None:
        no_grad_forward(self.engine, self._input(x), self.llama)

    def boundary(self, boundary: bool) -> None:
        """Before a micro-step's backward: ``manual_boundary`` tells the engine whether it is the last one."""
        if self.manual:
            self.engine.set_gradient_accumulation_boundary(boundary)

    def backward(self, kind: BackwardKind, out: torch.Tensor, loss: torch.Tensor, fused: bool, part: float = 1.0,
                 keep: bool = False) -> None:
        part *= self.share
        if kind is BackwardKind.ENGINE:
            if keep:
                self.engine.backward(part * loss, retain_graph=True)
            else:
                self.engine.backward(loss if part == 1.0 else part * loss)
        elif kind is BackwardKind.TORCH:
            loss = loss if part == 1.0 else part * loss
            if self.dtype is torch.float16:  # DeepSpeed's API for a PyTorch-style backward with a loss scaler
                loss = self.engine.scale(loss)
            loss.backward(retain_graph=keep)
        else:
            g = torch.ones_like(loss) if fused else (2 * out / out.numel()).detach()
            (loss if fused else out).backward(gradient=g if part == 1.0 else part * g, retain_graph=keep)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def micro_done(self, boundary: bool) -> None:
        if self.manual and not boundary:
            return  # manual boundary: one engine.step() per train step, after the last backward
        self.engine.step()  # DeepSpeed's loop: step() after every micro-step; it updates at the boundary

    def lr_step(self) -> None:
        if self.user_scheduler is not None:
            self.user_scheduler.step()

    def params(self) -> Params:
        out = {}
        for n, p in self.engine.module.named_parameters():
            status = _zero_status(p)
            if status == "AVAILABLE":
                out[n] = p.detach().cpu().clone()  # gathered (persistent): GatheredParameters would partition it
            elif status is not None:  # ZeRO-3: read the (world size 1: whole) partition
                import deepspeed
                with deepspeed.zero.GatheredParameters([p]):
                    out[n] = p.detach().cpu().clone()
            else:
                out[n] = p.detach().cpu().clone()
        return out

    def masters(self) -> Params | None:
        """The fp32 master copy of each parameter the optimizer steps, in mixed precision: at ZeRO-1/2/3 and with
        ``BF16_Optimizer`` through ``deepspeed.utils.safe_get_full_fp32_param`` (at ZeRO-3 a collective every rank
        calls), at ZeRO-0 from ``FP16_Optimizer``'s flat fp32 groups or ``FP16_UnfusedOptimizer``'s fp32 groups
        (`stage0_masters`); None in fp32 and when no parameter has one."""
        if self.fp32:
            return None
        if self.stage == 0:
            return stage0_masters(self.engine.module, self.engine.optimizer) or None
        from deepspeed.utils import safe_get_full_fp32_param
        out = {}
        for n, p in self.engine.module.named_parameters():
            if n in self.masters_unread:
                continue
            try:
                m = safe_get_full_fp32_param(p)
            except Exception as exc:  # noqa: BLE001 -- zerostate's probe, not the user's code: never a finding
                # ZeRO-3 raises KeyError for a parameter in no optimizer group (it has no fp32 partition)
                self.masters_unread[n] = f"{type(exc).__name__}: {exc}"
                continue
            if m is not None:
                out[n] = m.detach().float().cpu().clone()
        return out or None

    def save_load(self, step: int) -> SaveLoadRecord:
        return round_trip(self, step)

    def resume(self, step: int) -> ResumeRecord:
        """HF Trainer's ``resume_from_checkpoint`` in a new process: ``engine.save_checkpoint(dir)``, the engine
        destroyed, the model built again as before training (``from_pretrained``'s weights, `build_engine_model`), a
        fresh engine from ``deepspeed.initialize`` with the same config, a new client optimizer and scheduler, and
        ``engine.load_checkpoint(dir)`` into it; training goes on with the fresh engine.  The directory is shared
        by the ranks and removed."""
        rec: ResumeRecord = {"step": step, "counters": [self.counters()]}
        with shared_checkpoint_dir() as path:
            self.engine.save_checkpoint(path)
            barrier()  # every rank's files are written
            rec["destroy_error"] = self.close()
            self._initialize(build_engine_model(self.sc))
            loaded, _ = self.engine.load_checkpoint(path)
            rec["loaded"] = loaded is not None
        rec["counters"].append(self.counters())
        return rec

    def counters(self) -> Counters:
        """The engine state a checkpoint round trip must keep: global / skipped steps, fp16's loss scale."""
        opt = self.engine.optimizer
        scale = opt.loss_scale if self.dtype is torch.float16 and isinstance(opt, _LossScaled) else None
        return {"global_steps": int(self.engine.global_steps), "skipped_steps": int(self.engine.skipped_steps),
                "loss_scale": None if scale is None else float(scale)}

    def fp16_state(self) -> Fp16State | None:
        """fp16: the train steps DeepSpeed skipped so far and its current loss scale, else None."""
        if self.dtype is not torch.float16 or self.engine is None:
            return None
        return {"skipped_steps": int(self.engine.skipped_steps), "loss_scale": float(self.engine.optimizer.loss_scale)}

    def close(self) -> str | None:
        """Destroy the engine; what ``destroy()`` raised, as a line, else None."""
        fp16.set_loss_scale(None)
        eng, self.engine = self.engine, None
        if isinstance(eng, _Destroyable):
            try:
                eng.destroy()
            except Exception as exc:  # noqa: BLE001 -- a broken engine's teardown: reported, not judged
                return f"{type(exc).__name__}: {exc}"
        return None


__all__ = ["DeepSpeedBackend", "EngineSettings", "Fp16State", "OptimizerBuilt", "build_engine_model",
           "build_zero_init", "engine_before_scenario", "engine_settings", "linear_in_use", "optimizer_built",
           "run_engines_before", "stage0_masters"]
