"""Scenario: the one input every target takes.

A scenario is a plain, immutable, hashable, JSON-serialisable value, and its own key: the explorer's memo,
positions and sets hold scenarios, and two scenarios are equal exactly when their JSON is equal.  It has three
parts:

* the **network**: a sequence of blocks.  Each block is ``norm -> lin`` (a
  LayerNorm followed by a Linear, the shape of seed 002's MRE); each of the two
  sub-modules is trainable, frozen (``requires_grad=False``, as LoRA or a
  quantized base freezes it) or unused (trainable but skipped by forward).
  A block is run plain, under reentrant activation checkpointing
  (``use_reentrant=True``) or non-reentrant checkpointing (the PyTorch and HF
  default).  Under ZeRO-3 a block may be a *z3 leaf module*.  Optionally the
  network ends in a *fused head*: a custom autograd Function that calls
  ``torch.autograd.backward`` inside its forward (the TiledFusedLogitsLoss
  pattern), i.e. a backward made before the user's backward.
* the **engine config** knobs: ZeRO stage, persistence threshold, prefetch
  bucket size, reduce bucket size, gradient accumulation steps.
* the **schedule**: train steps, each with ``gas`` micro-steps; each micro-step
  names its backward kind (``engine.backward(loss)``, ``loss.backward()``,
  ``out.backward(gradient)``), and a step may start with an eval / no_grad
  forward (which matters to the ZeRO-3 trace).

Training-setup dimensions (each written to JSON only when not at its default, so a scenario file that
does not use one stays byte-identical and parses): precision (bf16 / fp16, fp32 gradient accumulation),
gradient clipping, CPU offload (optimizer / parameters), several optimizer parameter groups and
parameters in no group, ``requires_grad`` changed for one step, a module applied twice (weight tying)
and a parameter used by a module that does not own it (a ZeRO-3 external parameter), tuple / dict
outputs and an auxiliary loss, two backwards per micro-step (``retain_graph=True``), a train step with
no forward or backward (``engine.step()`` without any gradient), and a second network family: tiny
Hugging Face Llama decoders (optionally wrapped by PEFT LoRA, with ``modules_to_save``), the ZeRO knobs
``contiguous_gradients``, ``overlap_comm`` and ZeRO-3's all-reduce fetch, a manually marked accumulation
boundary (``set_gradient_accumulation_boundary``), a module attached after ``deepspeed.initialize``, and
``engines_before``: other engines built, trained and destroyed in the same process before the scenario's
own (TRL's policy, reference and reward models), where DeepSpeed state carried between engines shows.
`Scenario.beyond_model` names the ones zerostate's model does not represent.

Parsing (`Scenario.from_json`) validates every field and raises
`ScenarioError` naming the field, so a malformed scenario file is a clear error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any, TypeVar

from .scenario_fields import (PARAMS_PER_SUBMODULE, SUBMODULES, BackwardKind, Block, Checkpoint, Family, Gather,
                              MicroStep, Offload, Optimizer, Outputs, ParamKind, Precision, Scheduler, TrainStep)


WORLD_SIZES = (1, 2, 4, 8)
"""A scenario's ranks: one process, or a rank pool of 2, 4 or 8 (powers of two up to one node's 8 GPUs)."""


class ScenarioError(ValueError):
    """A scenario value or file is malformed.  The message names the field."""


@dataclass(frozen=True)
class Scenario:
    """A network, its engine config and a schedule.  See the module docstring."""

    blocks: tuple[Block, ...] = (Block(),)
    steps: tuple[TrainStep, ...] = (TrainStep(),)
    stage: int = 3
    fused_head: bool = False
    """A final Linear head whose loss is a custom Function calling autograd.backward in forward."""
    input_requires_grad: bool = True
    """Whether the network input requires grad (reentrant checkpoint needs it to reach the block's params)."""
    width: int = 8
    persistence_threshold: int = 0
    prefetch_bucket_size: int = 0
    reduce_bucket_size: int = 500_000_000
    seed: int = 0
    max_reuse_distance: int = 1_000_000_000
    """ZeRO-3 ``stage3_max_reuse_distance`` (DeepSpeed's default 1e9; written to JSON only when set)."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3 ``stage3_max_live_parameters`` (DeepSpeed's default 1e9; written to JSON only when set)."""
    precision: Precision = Precision.FP32
    gradient_clipping: float = 0.0
    """Set explicitly (DeepSpeed's default is 1.0 from 0.19.5); 0 disables clipping."""
    loss_scale_power: int = 8
    """fp16 only: DeepSpeed's ``fp16.initial_scale_power`` (dynamic loss scaling from 2**power; 16 is
    DeepSpeed's default, whose scaled gradients overflow fp16 in some scenarios: the step is skipped and
    the scale halves).  Written to JSON only when not 8."""
    fp32_grad_accum: bool = False
    """bf16 only: ``data_types.grad_accum_dtype = "fp32"`` (gradients accumulated in fp32)."""
    offload: Offload = Offload.NONE
    param_groups: int = 1
    """Optimizer parameter groups (1-3) with different learning rates; block ``i`` is in group
    ``i % param_groups`` (the head in group 0)."""
    tie: bool = False
    """Block 0's Linear is applied once more after the last block (a shared embedding / LM head)."""
    external: bool = False
    """The root module uses block 0's Linear weight itself (``F.linear``): a ZeRO-3 external parameter."""
    outputs: Outputs = Outputs.TENSOR
    losses: int = 1
    """2: an auxiliary loss on the ``aux`` output is added to the main loss."""
    family: Family = Family.BLOCKS
    lora: bool = False
    """Llama family: the model is wrapped by PEFT LoRA (base weights frozen, adapters trainable)."""
    modules_to_save: bool = False
    """Llama family with LoRA: ``LoraConfig(modules_to_save=["lm_head"])`` -- PEFT wraps the head in a
    ``ModulesToSaveWrapper`` holding a trainable copy (DeepSpeed #8144: ZeRO-3 found hook attributes on the
    wrapper through PEFT's attribute delegation)."""
    manual_boundary: bool = False
    """DeepSpeed's ``gradient_accumulation_steps`` is 1 and the loop marks the boundary itself:
    ``engine.set_gradient_accumulation_boundary(micro == gas - 1)`` before each micro-step's backward (each
    loss divided by ``gas`` by the loop), ``engine.step()`` once per train step (the API of DeepSpeed #7665;
    #7981 fixed its ZeRO-1/2 optimizer-offload path).  The oracle is unchanged: ``gas`` micro-steps averaged."""
    contiguous_gradients: bool = True
    """ZeRO ``contiguous_gradients`` (DeepSpeed's default true; false takes ZeRO-1/2's
    ``buffered_reduce_fallback`` path, fixed for CPU tensors in 0.19.8)."""
    overlap_comm: bool | None = None
    """ZeRO ``overlap_comm``; None: DeepSpeed's default (on for ZeRO-3, off for ZeRO-1/2)."""
    reduce_scatter: bool = True
    """ZeRO ``reduce_scatter`` (DeepSpeed's default true); false reduces ZeRO-1/2's buckets by all-reduce and
    makes ZeRO-3 reduce from its contiguous gradient buffer."""
    all_reduce_fetch: bool = False
    """ZeRO-3 ``stage3_use_all_reduce_for_fetch_params`` (DeepSpeed #8158 fixed its padding in 0.19.4)."""
    late_module: bool = False
    """Blocks family: a parameterless module (``nn.Identity``) is attached to the model *after*
    ``deepspeed.initialize`` and applied to the output (an adapter or wrapper added late; DeepSpeed #8009)."""
    engines_before: tuple[int, ...] = ()
    """ZeRO stages of other engines that run first, in this process, one after another: each is built on a
    fresh copy of this scenario's network (z3 leaf flags cleared) with that stage, trained one plain train
    step (``gas`` x ``engine.backward``) and destroyed; then the scenario's own engine runs.  Empty (the
    default, written to JSON only when set): the scenario's engine is the only one.  The PyTorch oracle is
    unchanged (it trains the same model)."""
    zero_init: bool = False
    """ZeRO-3: the model is built as Hugging Face's ``from_pretrained`` builds it when ZeRO-3 is configured --
    inside ``deepspeed.zero.Init`` (parameters partitioned and cast to the precision's dtype as they are
    made), weights loaded under ``GatheredParameters``; PEFT's LoRA adapters made afterwards stay fp32
    (the mixed dtypes of DeepSpeed #8072/#8073)."""
    world_size: int = 1
    """The ranks this scenario runs on, at least (`WORLD_SIZES`; written to JSON only above 1).  A world-size-1
    DeepSpeed target runs a world-size-2 or -4 scenario on a rank pool of its own (`targets.deepspeed.ranks`), so
    the default exploration reaches what only several ranks show: gradient averaging across ranks
    (DeepSpeed's 0.19.8 CPU reduce fix), all-gathers of mixed dtypes (#8072/#8073), partition padding
    (#8158).  Each rank trains on its own rows of the batch; the oracle trains on the whole batch.  The model
    is per rank, so the field changes nothing it checks; a target at a larger world size runs the scenario
    at its own."""
    empty_param: bool = False
    """Blocks family: the network also holds a trainable parameter with no elements (``torch.empty(0)``),
    registered last -- trailing every optimizer group -- and used in forward (its sum, zero, is added to the
    output): the extreme of the parameter-shape edges.  DeepSpeed #8279 (ZeRO-1/2 reduction of a trailing
    zero-sized parameter, fixed in 0.19.6 by #8280) and ZeRO-3's coalesced all-gather of a sized and a
    zero-sized parameter at world size 2 (open; DeepSpeed PR #8375)."""
    optimizer: Optimizer = Optimizer.SGD
    """Who builds the optimizer (`Optimizer`): a client SGD, or DeepSpeed from its config (``config-adam``).
    Not in `beyond_model`: the hook and coordinator events the model checks happen in backward and at the
    boundary, before the optimizer's ``step()`` on ZeRO's flat fp32 partitions, and which update rule that step
    applies (or who constructed it) changes none of them -- the same scenario with SGD and with config Adam gives
    the same trace (test_deepspeed_setups.py ``test_config_adam_leaves_the_trace_unchanged``), so the model's
    agreement check still applies."""

    decay_groups: bool = False
    """The optimizer's parameter groups as HF Trainer builds them (``create_optimizer``): the trainable weights
    of Linear layers (decay) and the rest -- biases, LayerNorms -- (no decay), both at the base learning rate,
    weight decay 0 as HF's default; a group left with no parameter is passed empty (with LoRA every trainable
    parameter is an adapter weight, so the second group is empty).  Not with ``param_groups`` > 1."""
    scheduler: Scheduler = Scheduler.NONE
    """A learning-rate schedule (`Scheduler`): none, passed to ``deepspeed.initialize``, or stepped by the loop.
    Model-neutral like ``optimizer``: it changes the rate the optimizer's ``step()`` applies, after every hook
    and coordinator event of the train step."""

    def __post_init__(self) -> None:
        """Equal scenarios have one JSON form: an integer clipping (equal to its float, so the same key) is held as
        the float the JSON and the parser give."""
        if type(self.gradient_clipping) is int:
            object.__setattr__(self, "gradient_clipping", float(self.gradient_clipping))

    # ------------------------------------------------------------------ derived
    @property
    def gas(self) -> int:
        """Gradient accumulation steps: the number of micro-steps per train step."""
        return len(self.steps[0].micro) if self.steps else 1

    @property
    def bf16_optimizer(self) -> bool:
        """DeepSpeed wraps the optimizer in ``BF16_Optimizer`` (engine.py ``_do_optimizer_sanity_check``): ZeRO-1,
        bf16 with fp32 gradient accumulation, no optimizer offload."""
        return (self.stage == 1 and self.precision is Precision.BF16 and self.fp32_grad_accum
                and self.offload is Offload.NONE)

    @property
    def fp16_optimizer(self) -> bool:
        """DeepSpeed wraps the optimizer in ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``: stage 0 in fp16 or
        bf16."""
        return self.stage == 0 and self.precision is not Precision.FP32

    @property
    def edited_block(self) -> int | None:
        """The block whose Linear weight a ``gather: edit`` halves: the first whose Linear is trainable and in the
        optimizer (family blocks), else None."""
        if self.family is not Family.BLOCKS:
            return None
        return next((i for i, b in enumerate(self.blocks) if b.lin is ParamKind.TRAINABLE and b.in_optimizer), None)

    @property
    def empty_group(self) -> bool:
        """One of ``decay_groups``' two groups holds no parameter: the no-decay one under LoRA (every trainable
        parameter an adapter weight), or, in the blocks family, either one where the trainable parameters in the
        optimizer are all norms and biases (every Linear frozen) or none is (no trainable norm or Linear)."""
        if not self.decay_groups:
            return False
        if self.family is Family.LLAMA:
            return self.lora
        held = [b for b in self.blocks if b.in_optimizer]
        decay = (any(b.lin is not ParamKind.FROZEN for b in held) or self.fused_head or self.empty_param)
        rest = any(b.norm is not ParamKind.FROZEN or b.lin is not ParamKind.FROZEN for b in held)
        return not (decay and rest)

    @property
    def num_micro_steps(self) -> int:
        return sum(len(s.micro) for s in self.steps)

    def micro_steps(self) -> Iterator[tuple[int, int, MicroStep]]:
        """Yield ``(step_index, micro_index, micro_step)`` in schedule order."""
        for si, step in enumerate(self.steps):
            for mi, micro in enumerate(step.micro):
                yield si, mi, micro

    def with_(self, **changes: Any) -> Scenario:
        return replace(self, **changes)

    def beyond_model(self) -> list[str]:
        """The training-setup dimensions this scenario uses that zerostate's model does not represent
        (its hook and coordinator machines know fp32 ``LayerNorm -> Linear`` blocks, one optimizer group
        holding every trainable parameter, one backward per micro-step).  Empty: the model covers it."""
        out = [f"{name}={_plain(getattr(self, name))}" for name, default in _EXTENDED_DEFAULTS.items()
               if getattr(self, name) != default and name not in _MODEL_NEUTRAL]
        if any(not b.in_optimizer for b in self.blocks):
            out.append("parameters in no optimizer group")
        if any(s.idle for s in self.steps):
            out.append("engine.step() without forward or backward")
        if any(s.frozen for s in self.steps):
            out.append("requires_grad changed between steps")
        if any(s.unused for s in self.steps):
            out.append("modules used in some steps only")
        if any(m.retain for _, _, m in self.micro_steps()):
            out.append("two backwards per micro-step (retain_graph)"
                       + (", engine.zero_grad() between them" if any(m.zero_grad for _, _, m in self.micro_steps())
                          else ""))
        if any(s.resume for s in self.steps):
            out.append("a fresh engine loads a checkpoint before step(s) " + ", ".join(
                str(i) for i, s in enumerate(self.steps) if s.resume) + " (the model runs one engine)")
        if self.stage == 3 and any(s.gather is not Gather.NONE for s in self.steps):  # ZeRO-1/2: a no-op context
            out.append("GatheredParameters of the loop's own (it gathers and partitions outside the coordinator)")
        if self.stage == 0:
            out.append("ZeRO stage 0 (no ZeRO optimizer, no hook manager: the specs do not apply)")
        if self.engines_before:
            out.append("engines before it in the process: "
                       + ", ".join(f"ZeRO-{k}" for k in self.engines_before))
        if self.stage == 3 and any(s.save_load for s in self.steps):  # ZeRO-1/2: no hook or trace event changes
            out.append("ZeRO-3 checkpoint save/load before step(s) " + ", ".join(
                str(i) for i, s in enumerate(self.steps) if s.save_load)
                       + " (its prologue releases every parameter, release_and_reset_all, and its epilogue "
                       "gathers the persistent ones: the model's coordinator has neither)")
        return out

    # -------------------------------------------------------------- validation
    def validate(self) -> Scenario:
        """Raise `ScenarioError` naming the first bad field; return self when valid."""
        if not self.blocks:
            raise ScenarioError("blocks: a scenario needs at least one block")
        if self.stage not in (0, 1, 2, 3):
            raise ScenarioError(f"stage: ZeRO stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if not self.steps:
            raise ScenarioError("steps: a scenario needs at least one train step")
        gas = len(self.steps[0].micro)
        for i, step in enumerate(self.steps):
            if not step.micro:
                raise ScenarioError(f"steps[{i}].micro: a train step needs at least one micro-step")
            if len(step.micro) != gas:
                raise ScenarioError(
                    f"steps[{i}].micro: every train step must have the same number of micro-steps "
                    f"(gradient_accumulation_steps={gas}), got {len(step.micro)}")
        for i, step in enumerate(self.steps):
            for j, micro in enumerate(step.micro):
                for b in micro.skip:
                    where = f"steps[{i}].micro[{j}].skip"
                    if not 0 <= b < len(self.blocks):
                        raise ScenarioError(f"{where}: block {b} does not exist ({len(self.blocks)} block(s))")
                    if self.blocks[b].norm is not ParamKind.FROZEN:
                        raise ScenarioError(f"{where}: block {b}'s norm is {self.blocks[b].norm.value}; only a "
                                            "frozen norm may be skipped (the branch must not change which "
                                            "parameters get gradients)")
                if len(set(micro.skip)) != len(micro.skip):
                    raise ScenarioError(f"steps[{i}].micro[{j}].skip: a block is listed twice")
        if self.width < 2:
            raise ScenarioError(f"width: must be at least 2, got {self.width}")
        for name in ("persistence_threshold", "prefetch_bucket_size", "reduce_bucket_size", "seed",
                     "max_reuse_distance", "max_live_parameters"):
            if getattr(self, name) < 0:
                raise ScenarioError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.reduce_bucket_size == 0:
            raise ScenarioError("reduce_bucket_size: must be > 0")
        self._validate_extended()
        return self

    def _validate_extended(self) -> None:
        if not (isinstance(self.gradient_clipping, (int, float)) and not isinstance(self.gradient_clipping, bool)
                and 0 <= self.gradient_clipping < float("inf")):
            raise ScenarioError(f"gradient_clipping: must be a finite number >= 0, got {self.gradient_clipping!r}")
        if self.fp32_grad_accum and self.precision is not Precision.BF16:
            raise ScenarioError("fp32_grad_accum: only with precision bf16 (DeepSpeed's grad_accum_dtype)")
        if self.loss_scale_power != 8 and (self.precision is not Precision.FP16
                                           or not 0 <= self.loss_scale_power <= 24):
            raise ScenarioError(f"loss_scale_power: only with precision fp16, 0..24, got {self.loss_scale_power}")
        if self.stage == 0 and self.offload is not Offload.NONE:
            raise ScenarioError("offload: ZeRO stage 0 has no offload")
        if self.stage == 0 and any(m.backward is not BackwardKind.ENGINE for _, _, m in self.micro_steps()):
            raise ScenarioError("steps: ZeRO stage 0 takes engine.backward only (DeepSpeed refuses a PyTorch-style "
                                "backward there: 'Direct calls to tensor.backward() are not supported')")
        if self.offload in (Offload.PARAM, Offload.BOTH) and self.stage != 3:
            raise ScenarioError(f"offload: parameter offload needs ZeRO-3, got stage {self.stage}")
        if not 1 <= self.param_groups <= 3:
            raise ScenarioError(f"param_groups: must be 1, 2 or 3, got {self.param_groups}")
        if self.losses not in (1, 2):
            raise ScenarioError(f"losses: must be 1 or 2, got {self.losses}")
        for i, step in enumerate(self.steps):
            for b in step.frozen:
                if not 0 <= b < len(self.blocks) or self.blocks[b].lin is not ParamKind.TRAINABLE:
                    raise ScenarioError(f"steps[{i}].frozen: block {b} has no trainable Linear to freeze")
            if len(set(step.frozen)) != len(step.frozen):
                raise ScenarioError(f"steps[{i}].frozen: a block is listed twice")
            for b in step.unused:
                if not 0 <= b < len(self.blocks) or self.blocks[b].lin is not ParamKind.TRAINABLE:
                    raise ScenarioError(f"steps[{i}].unused: block {b} has no trainable Linear to leave unused")
            if len(set(step.unused)) != len(step.unused) or set(step.unused) & set(step.frozen):
                raise ScenarioError(f"steps[{i}].unused: a block is listed twice, or also frozen")
            if step.unused and step.idle:
                raise ScenarioError(f"steps[{i}].unused: an idle step has no forward")
            if not isinstance(step.save_load, bool):
                raise ScenarioError(f"steps[{i}].save_load: expected true or false, got {step.save_load!r}")
            if not isinstance(step.resume, bool) or (step.resume and step.save_load):
                raise ScenarioError(f"steps[{i}].resume: true or false, and not with save_load in the same step")
            if step.resume and i == 0:
                raise ScenarioError("steps[0].resume: a resume needs a train step before it to checkpoint")
            if step.gather_inside and (step.gather is Gather.NONE or step.idle):
                raise ScenarioError(f"steps[{i}].gather_inside: needs a gather and a step with a backward")
            if step.gather is Gather.EDIT and self.edited_block is None:
                raise ScenarioError(f"steps[{i}].gather: an edit needs a block whose Linear is trainable and in the "
                                    "optimizer (family blocks)")
            for j, m in enumerate(step.micro):
                if m.zero_grad and (not m.retain or len(step.micro) != 1):
                    raise ScenarioError(f"steps[{i}].micro[{j}].zero_grad: needs retain (two backwards to clear "
                                        "between) and one micro-step per train step (gas 1)")
            if step.idle and (step.frozen or step.eval_before or any(m.skip or m.retain for m in step.micro)):
                raise ScenarioError(f"steps[{i}].idle: an idle step has no forward, so nothing to skip, "
                                    "freeze, retain or evaluate")
        if (self.tie or self.external) and self.family is Family.BLOCKS and self.blocks[0].lin is ParamKind.UNUSED:
            raise ScenarioError("tie/external: block 0's Linear is unused; tying or sharing needs it in forward")
        if self.lora and self.family is not Family.LLAMA:
            raise ScenarioError("lora: only for family llama")
        if self.modules_to_save and not self.lora:
            raise ScenarioError("modules_to_save: only with lora (family llama)")
        if not self.reduce_scatter and self.stage == 0:
            raise ScenarioError("reduce_scatter: a ZeRO-1/2/3 option, got stage 0")
        if self.all_reduce_fetch and self.stage != 3:
            raise ScenarioError(f"all_reduce_fetch: a ZeRO-3 option, got stage {self.stage}")
        if self.late_module and self.family is not Family.BLOCKS:
            raise ScenarioError("late_module: only for family blocks")
        if self.overlap_comm is not None and not isinstance(self.overlap_comm, bool):
            raise ScenarioError(f"overlap_comm: expected true, false or absent, got {self.overlap_comm!r}")
        if self.zero_init and self.stage != 3:
            raise ScenarioError(f"zero_init: a ZeRO-3 option, got stage {self.stage}")
        if self.empty_param and self.family is not Family.BLOCKS:
            raise ScenarioError("empty_param: only for family blocks")
        if self.world_size not in WORLD_SIZES:
            raise ScenarioError(f"world_size: 1, 2, 4 or 8, got {self.world_size!r}")
        if not isinstance(self.optimizer, Optimizer):
            raise ScenarioError(f"optimizer: expected one of {[o.value for o in Optimizer]}, got {self.optimizer!r}")
        if not isinstance(self.scheduler, Scheduler):
            raise ScenarioError(f"scheduler: expected one of {[o.value for o in Scheduler]}, got {self.scheduler!r}")
        if self.scheduler is Scheduler.USER and self.optimizer is not Optimizer.SGD:
            raise ScenarioError("scheduler: 'user' schedules the client optimizer the loop built (optimizer sgd); "
                                "with DeepSpeed's own optimizer pass it to initialize ('initialize')")
        if self.decay_groups and self.param_groups != 1:
            raise ScenarioError("decay_groups: HF Trainer's two groups replace param_groups; "
                                f"got param_groups={self.param_groups}")
        if len(self.engines_before) > 3 or any(k not in (1, 2, 3) for k in self.engines_before):
            raise ScenarioError(f"engines_before: at most 3 ZeRO stages (1, 2 or 3), got {list(self.engines_before)}")
        if self.family is Family.LLAMA:
            if self.width % 4:
                raise ScenarioError(f"width: the llama family needs a multiple of 4 (2 heads), got {self.width}")
            plain = [Block(checkpoint=self.blocks[0].checkpoint)] * len(self.blocks)
            if list(self.blocks) != plain:
                raise ScenarioError("blocks: in the llama family a block is one decoder layer; only the "
                                    "checkpoint mode may be set, the same for every block")
            bad = [n for n in ("fused_head", "external") if getattr(self, n)]
            bad += ["outputs"] * (self.outputs is not Outputs.TENSOR) + ["losses"] * (self.losses != 1)
            bad += ["param_groups"] * (self.param_groups != 1)
            if bad:
                raise ScenarioError(f"{bad[0]}: not available in the llama family")
            for i, step in enumerate(self.steps):
                if step.frozen or step.unused or any(m.skip or m.backward is BackwardKind.NONSCALAR
                                                     for m in step.micro):
                    raise ScenarioError(f"steps[{i}]: the llama family has no skip/frozen/unused/nonscalar backward")

    # --------------------------------------------------------------- summaries
    def describe(self) -> str:
        """One line per block and step, in words, for reports."""
        lines = [f"ZeRO-{self.stage}, {len(self.blocks)} block(s), width {self.width}, "
                 f"gas {self.gas}, {len(self.steps)} train step(s), "
                 f"persistence threshold {self.persistence_threshold}"
                 + (f", world size {self.world_size}" if self.world_size > 1 else "")
                 + (", fused head (backward inside forward)" if self.fused_head else "")
                 + ("" if self.input_requires_grad else ", input does not require grad")]
        if self.beyond_model():
            lines.append("  setup: " + ", ".join(self.beyond_model()))
        if self.optimizer is not Optimizer.SGD:
            lines.append(f"  optimizer: {self.optimizer.value} (DeepSpeed builds torch AdamW from its config)")
        if self.scheduler is not Scheduler.NONE:
            lines.append("  lr scheduler: linear decay, " + (
                "passed to deepspeed.initialize" if self.scheduler is Scheduler.INITIALIZE
                else "stepped by the loop after each engine.step()"))
        for i, b in enumerate(self.blocks):
            ck = {"none": "plain", "reentrant": "reentrant checkpoint",
                  "non_reentrant": "non-reentrant checkpoint"}[b.checkpoint.value]
            lines.append(f"  block {i}: {ck}; norm {b.norm.value}, lin {b.lin.value}"
                         + ("; z3 leaf module" if b.leaf else ""))
        for i, s in enumerate(self.steps):
            kinds = ", ".join(m.backward.value for m in s.micro)
            skips = "; ".join([f"micro-step {j} skips the norm of block(s) {list(m.skip)}"
                               for j, m in enumerate(s.micro) if m.skip]
                              + [f"micro-step {j}: two backwards, engine.zero_grad() between them"
                                 for j, m in enumerate(s.micro) if m.zero_grad])
            if s.save_load:
                lines.append(f"  before step {i}: checkpoint saved and loaded")
            if s.resume:
                lines.append(f"  before step {i}: checkpoint saved, loaded into a fresh engine that trains on")
            if s.unused:
                lines.append(f"  step {i}: the Linear of block(s) {list(s.unused)} not used in its forwards")
            if s.gather is not Gather.NONE:
                what = ("every parameter read" if s.gather is Gather.READ
                        else f"block {self.edited_block}'s Linear weight halved (its fp32 master too)")
                lines.append(f"  step {i}: GatheredParameters, {what}, "
                             + ("after micro-step 0's backward" if s.gather_inside else "before its first forward"))
            lines.append(f"  step {i}: " + ("hooks re-registered, then " if s.reregister else "")
                         + ("eval forward, then " if s.eval_before else "")
                         + f"backward kinds [{kinds}], then engine.step()" + (f" ({skips})" if skips else ""))
        return "\n".join(lines)

    # -------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = _plain(asdict(self))
        for k in ("max_reuse_distance", "max_live_parameters"):  # DeepSpeed's defaults: files stay identical
            if d.get(k) == 1_000_000_000:
                d.pop(k)
        for step in d["steps"]:  # written only when set, so files that do not use them stay identical
            for k in ("reregister", "idle", "frozen", "save_load", "unused", "gather_inside", "resume"):
                if not step.get(k):
                    step.pop(k, None)
            if step.get("gather") == Gather.NONE.value:
                step.pop("gather")
            for micro in step["micro"]:
                for k in ("skip", "retain", "zero_grad"):
                    if not micro.get(k):
                        micro.pop(k, None)
        for block in d["blocks"]:
            if block.get("in_optimizer", True):
                block.pop("in_optimizer", None)
        for name, default in _EXTENDED_DEFAULTS.items():
            if getattr(self, name) == default:
                d.pop(name, None)
        if not self.engines_before:  # written only when set
            d.pop("engines_before", None)
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @staticmethod
    def from_dict(data: object) -> Scenario:
        """The scenario a parsed JSON value holds (`ScenarioError` naming the field when it holds none)."""
        return _parse_scenario(data)

    @staticmethod
    def from_json(text: str) -> Scenario:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScenarioError(f"not valid JSON: {exc}") from None
        return _parse_scenario(data)

    @staticmethod
    def load(path: str) -> Scenario:
        """Read a scenario file; errors name the file and the field."""
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ScenarioError(f"{path}: cannot read scenario file: {exc.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScenarioError(f"{path}: not valid JSON: {exc}") from None
        if isinstance(data, dict) and "scenario" in data and "blocks" not in data:
            data = data["scenario"]  # a finding file: {"check": ..., "scenario": {...}}
        try:
            return _parse_scenario(data)
        except ScenarioError as exc:
            raise ScenarioError(f"{path}: {exc}") from None

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.to_json() + "\n")


# ---------------------------------------------------------------------- parsing
_E = TypeVar("_E", bound=Enum)


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _enum(cls: type[_E], value: object, where: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ScenarioError(f"{where}: expected one of {allowed}, got {value!r}") from None


def _obj(value: object, where: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{where}: expected an object, got {type(value).__name__}")
    unknown = set(value) - allowed
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(allowed)}")
    return value


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{where}: expected an integer, got {value!r}")
    return value


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(f"{where}: expected true or false, got {value!r}")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ScenarioError(f"{where}: expected a list, got {type(value).__name__}")
    return value


_BLOCK_FIELDS = {"checkpoint", "norm", "lin", "leaf", "in_optimizer"}
_STEP_FIELDS = {"micro", "eval_before", "reregister", "idle", "frozen", "save_load", "unused", "gather",
                "gather_inside", "resume"}
_MICRO_FIELDS = {"backward", "skip", "retain", "zero_grad"}
_EXTENDED_DEFAULTS: dict[str, Any] = {
    "precision": Precision.FP32, "gradient_clipping": 0.0, "loss_scale_power": 8, "fp32_grad_accum": False,
    "offload": Offload.NONE,
    "param_groups": 1, "tie": False, "external": False, "outputs": Outputs.TENSOR, "losses": 1,
    "family": Family.BLOCKS, "lora": False, "modules_to_save": False, "manual_boundary": False,
    "contiguous_gradients": True, "overlap_comm": None, "reduce_scatter": True, "all_reduce_fetch": False,
    "late_module": False,
    "world_size": 1, "zero_init": False, "optimizer": Optimizer.SGD, "empty_param": False, "decay_groups": False,
    "scheduler": Scheduler.NONE}
"""Scenario fields written to JSON only when not at their default, with those defaults."""
_MODEL_NEUTRAL = ("optimizer", "world_size", "scheduler")
"""Fields of `_EXTENDED_DEFAULTS` that leave the model's events unchanged (not listed by `beyond_model`)."""
_SCENARIO_FIELDS = set(Scenario.__dataclass_fields__)


def _parse_block(value: object, where: str) -> Block:
    d = _obj(value, where, _BLOCK_FIELDS)
    return Block(
        checkpoint=_enum(Checkpoint, d.get("checkpoint", "none"), f"{where}.checkpoint"),
        norm=_enum(ParamKind, d.get("norm", "trainable"), f"{where}.norm"),
        lin=_enum(ParamKind, d.get("lin", "trainable"), f"{where}.lin"),
        leaf=_bool(d.get("leaf", False), f"{where}.leaf"),
        in_optimizer=_bool(d.get("in_optimizer", True), f"{where}.in_optimizer"),
    )


def _parse_micro(value: object, where: str) -> MicroStep:
    d = _obj(value, where, _MICRO_FIELDS)
    skip = tuple(_int(b, f"{where}.skip[{k}]") for k, b in enumerate(_list(d.get("skip", []), f"{where}.skip")))
    return MicroStep(backward=_enum(BackwardKind, d.get("backward", "engine"), f"{where}.backward"), skip=skip,
                     retain=_bool(d.get("retain", False), f"{where}.retain"),
                     zero_grad=_bool(d.get("zero_grad", False), f"{where}.zero_grad"))


def _parse_step(value: object, where: str) -> TrainStep:
    d = _obj(value, where, _STEP_FIELDS)
    micro = tuple(_parse_micro(m, f"{where}.micro[{j}]")
                  for j, m in enumerate(_list(d.get("micro", [{}]), f"{where}.micro")))
    return TrainStep(micro=micro, eval_before=_bool(d.get("eval_before", False), f"{where}.eval_before"),
                     reregister=_bool(d.get("reregister", False), f"{where}.reregister"),
                     idle=_bool(d.get("idle", False), f"{where}.idle"),
                     frozen=tuple(_int(b, f"{where}.frozen[{k}]")
                                  for k, b in enumerate(_list(d.get("frozen", []), f"{where}.frozen"))),
                     save_load=_bool(d.get("save_load", False), f"{where}.save_load"),
                     unused=tuple(_int(b, f"{where}.unused[{k}]")
                                  for k, b in enumerate(_list(d.get("unused", []), f"{where}.unused"))),
                     gather=_enum(Gather, d.get("gather", "none"), f"{where}.gather"),
                     gather_inside=_bool(d.get("gather_inside", False), f"{where}.gather_inside"),
                     resume=_bool(d.get("resume", False), f"{where}.resume"))


def _parse_scenario(data: object) -> Scenario:
    d = _obj(data, "scenario", _SCENARIO_FIELDS)
    defaults = Scenario()
    kwargs: dict[str, Any] = {}
    kwargs["blocks"] = tuple(_parse_block(b, f"blocks[{i}]")
                             for i, b in enumerate(_list(d.get("blocks", [{}]), "blocks")))
    kwargs["steps"] = tuple(_parse_step(s, f"steps[{i}]")
                            for i, s in enumerate(_list(d.get("steps", [{}]), "steps")))
    for name in ("stage", "width", "persistence_threshold", "prefetch_bucket_size",
                 "reduce_bucket_size", "seed", "max_reuse_distance", "max_live_parameters", "world_size"):
        kwargs[name] = _int(d.get(name, getattr(defaults, name)), name)
    for name in ("fused_head", "input_requires_grad", "fp32_grad_accum", "tie", "external", "lora",
                 "modules_to_save", "manual_boundary", "contiguous_gradients", "reduce_scatter", "all_reduce_fetch",
                 "late_module", "zero_init", "empty_param", "decay_groups"):
        kwargs[name] = _bool(d.get(name, getattr(defaults, name)), name)
    for name in ("param_groups", "losses", "loss_scale_power"):
        kwargs[name] = _int(d.get(name, getattr(defaults, name)), name)
    for name, cls in (("precision", Precision), ("offload", Offload), ("outputs", Outputs), ("family", Family)):
        kwargs[name] = _enum(cls, d.get(name, getattr(defaults, name).value), name)
    if d.get("overlap_comm") is not None:
        kwargs["overlap_comm"] = _bool(d["overlap_comm"], "overlap_comm")
    clip = d.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)):
        raise ScenarioError(f"gradient_clipping: expected a number, got {clip!r}")
    kwargs["gradient_clipping"] = float(clip)
    kwargs["engines_before"] = tuple(_int(k, f"engines_before[{i}]")
                                     for i, k in enumerate(_list(d.get("engines_before", []), "engines_before")))
    kwargs["optimizer"] = _enum(Optimizer, d.get("optimizer", defaults.optimizer.value), "optimizer")
    kwargs["scheduler"] = _enum(Scheduler, d.get("scheduler", defaults.scheduler.value), "scheduler")
    return Scenario(**kwargs).validate()


__all__ = [
    "BackwardKind", "Block", "Checkpoint", "Family", "Gather", "MicroStep", "Offload", "Outputs",
    "PARAMS_PER_SUBMODULE", "ParamKind", "Precision", "Optimizer", "Scheduler",
    "SUBMODULES", "Scenario", "ScenarioError", "TrainStep", "WORLD_SIZES",
]
