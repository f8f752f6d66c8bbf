"""The setup dimensions `zerostate doctor` compares: each read off a known issue's repro scenario and off a user's
setup (its DeepSpeed config, its trainer's arguments, its model), in one table.

A dimension's *neutral* value is the one a repro needs nothing at (fp32, no offload, no checkpointing, one engine):
a repro at any other value needs the user's setup to have that value too.  The repros are shrunk scenarios, so what
they hold beyond the neutral values is what their finding needed; the family of an issue is the setups that have
everything one of its repros has.  ``Kind`` says who decides a dimension: the config, the model, or the training
loop (which no config shows, so the doctor can only say "if your loop does this")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from zerostate.model.scenario import (BackwardKind, Checkpoint, Family, Gather, Offload, Optimizer, Outputs, ParamKind,
                                      Precision, Scenario, Scheduler)

Value = bool | int | str
"""A dimension's value: a flag, a number (stage, world size) or a name (precision)."""


class Kind(str, Enum):
    """Who decides a dimension's value, so who can say it and who can change it."""

    CONFIG = "config"
    """The DeepSpeed config (or the trainer arguments that write it): read from the files given."""
    MODEL = "model"
    """The model and how it is wrapped (PEFT, checkpointing, leaf modules): from the trainer's arguments or the
    model options."""
    LOOP = "loop"
    """What the training loop does between forward and step (a second backward, a frozen parameter toggled, an
    eval forward): a trainer preset says it; a config alone never does."""


@dataclass(frozen=True)
class Dimension:
    name: str
    kind: Kind
    phrase: str
    """The condition in words; ``{v}`` stands for the required value where the dimension is not a flag."""
    of_scenario: Callable[[Scenario], Value]
    neutral: Value | None
    """The value a repro needs nothing at; None: every repro needs its own value (the ZeRO stage)."""
    at_least: bool = False
    """A user's value meets a requirement when it is at least that value (ranks), not only when equal."""
    choices: tuple[str, ...] = ()
    """A named dimension's values (empty: any)."""

    def required(self, sc: Scenario) -> Value | None:
        """What a repro needs of this dimension, or None when it needs nothing."""
        v = self.of_scenario(sc)
        return None if self.neutral is not None and v == self.neutral else v

    def holds(self, required: Value, user: Value) -> bool:
        if self.at_least and isinstance(required, int) and isinstance(user, int):
            return user >= required
        return user == required

    def says(self, value: Value) -> str:
        if isinstance(value, bool):
            return self.phrase if value else f"not: {self.phrase}"
        return self.phrase.format(v=value)


def _gathered(sc: Scenario) -> Value:
    """The strongest of the loop's own GatheredParameters: an edit over a read."""
    kinds = {s.gather for s in sc.steps}
    return "edit" if Gather.EDIT in kinds else "read" if Gather.READ in kinds else "none"


def _scheduler(sc: Scenario) -> str:
    """Who builds the scheduler, over which optimizer: with DeepSpeed's own optimizer (config Adam) a scheduler
    passed to initialize is a callable DeepSpeed calls with it (`net.engine`), so DeepSpeed builds it."""
    if sc.scheduler is Scheduler.INITIALIZE and sc.optimizer is Optimizer.CONFIG_ADAM:
        return "deepspeed"
    return sc.scheduler.value


def _ckpt(sc: Scenario, mode: Checkpoint) -> bool:
    return any(b.checkpoint is mode for b in sc.blocks)


def _frozen(sc: Scenario) -> bool:
    return sc.lora or any(b.has_frozen for b in sc.blocks)


def _frozen_in_checkpointed(sc: Scenario) -> bool:
    if sc.family is Family.LLAMA:  # the decoder layers are checkpointed whole; LoRA freezes their base weights
        return sc.lora and any(b.checkpoint is not Checkpoint.NONE for b in sc.blocks)
    return any(b.checkpoint is not Checkpoint.NONE and b.has_frozen for b in sc.blocks)


def _backward(sc: Scenario, kind: BackwardKind) -> bool:
    return any(m.backward is kind for _, _, m in sc.micro_steps())


def _nested_outputs(sc: Scenario) -> bool:
    # a Hugging Face model computes its loss from logits inside forward: a loss on an output made from another
    # output, the shape the two-loss tuple/dict networks give (known.setups.nested_outputs_zero12 reads it alike)
    return sc.family is Family.LLAMA or (sc.outputs is not Outputs.TENSOR and sc.losses == 2)


DEFAULT_BUCKET = Scenario().reduce_bucket_size

DIMENSIONS: tuple[Dimension, ...] = (
    # -- the DeepSpeed config
    Dimension("stage", Kind.CONFIG, "ZeRO stage {v}", lambda sc: sc.stage, None),
    Dimension("precision", Kind.CONFIG, "{v} training", lambda sc: sc.precision.value, Precision.FP32.value),
    Dimension("fp32_grad_accum", Kind.CONFIG, "bf16 gradients accumulated in fp32 (data_types.grad_accum_dtype)",
              lambda sc: sc.fp32_grad_accum, False),
    Dimension("offload_optimizer", Kind.CONFIG, "optimizer offload to CPU (offload_optimizer)",
              lambda sc: sc.offload in (Offload.OPTIMIZER, Offload.BOTH), False),
    Dimension("offload_param", Kind.CONFIG, "parameter offload to CPU (offload_param)",
              lambda sc: sc.offload in (Offload.PARAM, Offload.BOTH), False),
    Dimension("adam", Kind.CONFIG, "an Adam optimizer (DeepSpeed's from the config, or a client AdamW)",
              lambda sc: sc.optimizer is Optimizer.CONFIG_ADAM, False),
    Dimension("clipping", Kind.CONFIG, "gradient clipping (gradient_clipping > 0)",
              lambda sc: sc.gradient_clipping > 0, False),
    Dimension("accumulation", Kind.CONFIG, "gradient accumulation (gradient_accumulation_steps > 1)",
              lambda sc: sc.gas > 1 and not sc.manual_boundary, False),
    Dimension("world_size", Kind.CONFIG, "at least {v} ranks", lambda sc: sc.world_size, 1, at_least=True),
    Dimension("persistent_params", Kind.CONFIG,
              "persistent small parameters (stage3_param_persistence_threshold > 0; DeepSpeed's default 1e5)",
              lambda sc: sc.stage == 3 and sc.persistence_threshold > 0, False),
    Dimension("prefetch", Kind.CONFIG, "ZeRO-3 prefetch (stage3_prefetch_bucket_size > 0; DeepSpeed's default 5e7)",
              lambda sc: sc.stage == 3 and sc.prefetch_bucket_size > 0, False),
    Dimension("live_or_reuse_limit", Kind.CONFIG,
              "stage3_max_live_parameters or stage3_max_reuse_distance set below DeepSpeed's default 1e9",
              lambda sc: sc.max_live_parameters < 10**9 or sc.max_reuse_distance < 10**9, False),
    Dimension("no_contiguous_gradients", Kind.CONFIG, "contiguous_gradients false",
              lambda sc: not sc.contiguous_gradients, False),
    Dimension("overlap_comm_changed", Kind.CONFIG,
              "overlap_comm against DeepSpeed's default for the stage (on at ZeRO-3, off at ZeRO-1/2)",
              lambda sc: sc.overlap_comm is not None and sc.overlap_comm != (sc.stage == 3), False),
    Dimension("no_reduce_scatter", Kind.CONFIG, "reduce_scatter false", lambda sc: not sc.reduce_scatter, False),
    Dimension("all_reduce_fetch", Kind.CONFIG, "stage3_use_all_reduce_for_fetch_params true",
              lambda sc: sc.all_reduce_fetch, False),
    # -- the model and how it is wrapped
    Dimension("zero_init", Kind.MODEL, "the model built inside deepspeed.zero.Init (HF from_pretrained under ZeRO-3, "
              "accelerate's zero3_init_flag)", lambda sc: sc.zero_init, False),
    Dimension("reentrant_checkpointing", Kind.MODEL, "reentrant activation checkpointing (use_reentrant=True)",
              lambda sc: _ckpt(sc, Checkpoint.REENTRANT), False),
    Dimension("non_reentrant_checkpointing", Kind.MODEL,
              "non-reentrant activation checkpointing (use_reentrant=False)",
              lambda sc: _ckpt(sc, Checkpoint.NON_REENTRANT), False),
    Dimension("frozen_params", Kind.MODEL, "frozen parameters (requires_grad=False: LoRA's base, a quantized base)",
              _frozen, False),
    Dimension("frozen_in_checkpointed", Kind.MODEL, "frozen parameters inside checkpointed modules",
              _frozen_in_checkpointed, False),
    Dimension("unused_params", Kind.MODEL, "trainable parameters the forward does not use",
              lambda sc: any(ParamKind.UNUSED in (b.norm, b.lin) for b in sc.blocks), False),
    Dimension("z3_leaf", Kind.MODEL, "ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules)",
              lambda sc: any(b.leaf for b in sc.blocks), False),
    Dimension("hf_model", Kind.MODEL, "a Hugging Face transformers model", lambda sc: sc.family is Family.LLAMA,
              False),
    Dimension("nested_outputs", Kind.MODEL, "a loss on an output computed from another output of the same forward "
              "(an HF model's loss from its logits, an auxiliary loss)", _nested_outputs, False),
    Dimension("lora", Kind.MODEL, "PEFT LoRA adapters", lambda sc: sc.lora, False),
    Dimension("modules_to_save", Kind.MODEL, "PEFT modules_to_save (a trainable copy of a module)",
              lambda sc: sc.modules_to_save, False),
    Dimension("shared_param", Kind.MODEL, "a parameter used by two modules (tied embeddings and LM head)",
              lambda sc: sc.tie or sc.external, False),
    Dimension("fused_loss", Kind.MODEL, "a loss function that runs a backward inside its forward (a tiled/fused "
              "logits loss calling torch.autograd.backward)", lambda sc: sc.fused_head, False),
    Dimension("input_without_grad", Kind.MODEL, "the first module's input does not require grad (frozen "
              "embeddings without enable_input_require_grads)", lambda sc: not sc.input_requires_grad, False),
    Dimension("param_outside_optimizer", Kind.MODEL, "trainable parameters in no optimizer group",
              lambda sc: any(not b.in_optimizer for b in sc.blocks), False),
    Dimension("param_groups", Kind.MODEL, "several optimizer parameter groups", lambda sc: sc.param_groups > 1,
              False),
    Dimension("empty_param", Kind.MODEL, "a parameter with no elements (torch.empty(0))",
              lambda sc: sc.empty_param, False),
    Dimension("hf_param_groups", Kind.MODEL, "HF Trainer's two optimizer groups (weights to decay, biases and norms "
              "not)", lambda sc: sc.decay_groups, False),
    Dimension("empty_param_group", Kind.MODEL, "an optimizer parameter group with no trainable parameter (HF's "
              "no-decay group under LoRA)", lambda sc: sc.empty_group, False),
    Dimension("small_reduce_bucket", Kind.MODEL, "a reduce bucket smaller than one parameter's gradient "
              "(reduce_bucket_size against your largest parameter)",
              lambda sc: sc.reduce_bucket_size < DEFAULT_BUCKET, False),
    # -- the training loop
    Dimension("several_engines", Kind.LOOP, "other DeepSpeed engines built and used in the same process first",
              lambda sc: bool(sc.engines_before), False),
    Dimension("late_module", Kind.LOOP, "a module attached to the model after deepspeed.initialize",
              lambda sc: sc.late_module, False),
    Dimension("retain_graph", Kind.LOOP, "two backwards of one forward (retain_graph=True)",
              lambda sc: any(m.retain for _, _, m in sc.micro_steps()), False),
    Dimension("pytorch_backward", Kind.LOOP, "loss.backward() called directly instead of engine.backward(loss)",
              lambda sc: _backward(sc, BackwardKind.TORCH), False),
    Dimension("nonscalar_backward", Kind.LOOP, "a backward of a non-scalar output (out.backward(gradient))",
              lambda sc: _backward(sc, BackwardKind.NONSCALAR), False),
    Dimension("eval_forward", Kind.LOOP, "a no_grad forward between train steps (evaluation, generation)",
              lambda sc: any(s.eval_before for s in sc.steps), False),
    Dimension("idle_step", Kind.LOOP, "engine.step() in a step with no backward",
              lambda sc: any(s.idle for s in sc.steps), False),
    Dimension("lr_scheduler", Kind.LOOP, "an LR scheduler: {v} (initialize: built over your optimizer and passed to "
              "deepspeed.initialize; user: stepped by your loop; deepspeed: built by DeepSpeed -- its config's, or a "
              "callable of the optimizer it builds; after: built over the optimizer initialize returned)", _scheduler,
              "none", choices=("none", "initialize", "user", "deepspeed", "after")),
    Dimension("freeze_toggle", Kind.LOOP, "requires_grad changed between train steps",
              lambda sc: any(s.frozen for s in sc.steps), False),
    Dimension("checkpoint_save", Kind.LOOP, "DeepSpeed checkpoints saved (and loaded) between train steps",
              lambda sc: any(s.save_load for s in sc.steps), False),
    Dimension("hooks_reregistered", Kind.LOOP, "ZeRO-3's module hooks removed and registered again between steps "
              "(TRL's unwrap_model_for_generation)", lambda sc: any(s.reregister for s in sc.steps), False),
    Dimension("module_skipped", Kind.LOOP, "a module skipped in some forwards (a branch, routing)",
              lambda sc: any(m.skip for _, _, m in sc.micro_steps()), False),
    Dimension("module_unused_in_step", Kind.LOOP, "a trainable module used in some train steps only (routing, a "
              "head used at eval)", lambda sc: any(s.unused for s in sc.steps), False),
    Dimension("zero_grad_between_backwards", Kind.LOOP, "zero_grad() between two backwards of one retained graph "
              "(separate losses of one forward, each stepped on its own)",
              lambda sc: any(m.zero_grad for _, _, m in sc.micro_steps()), False),
    Dimension("resume_fresh_engine", Kind.LOOP, "training resumed from a DeepSpeed checkpoint into a freshly built "
              "engine (HF Trainer's resume_from_checkpoint)", lambda sc: any(s.resume for s in sc.steps), False),
    Dimension("gathered_parameters", Kind.LOOP, "deepspeed.zero.GatheredParameters in your loop: {v} (read: "
              "parameters gathered and read, as TRL's weight sync to vLLM; edit: a trained parameter changed under "
              "modifier_rank=0, its fp32 master with safe_set_full_fp32_param)", _gathered, "none",
              choices=("none", "read", "edit")),
    Dimension("gathered_inside_step", Kind.LOOP, "that GatheredParameters between a backward and engine.step() "
              "(an on_pre_optimizer_step callback)", lambda sc: any(s.gather_inside for s in sc.steps), False),
    Dimension("manual_boundary", Kind.LOOP, "the loop marks the accumulation boundary itself "
              "(set_gradient_accumulation_boundary)", lambda sc: sc.manual_boundary, False),
)

BY_NAME = {d.name: d for d in DIMENSIONS}


def requirements(sc: Scenario, world_size: int = 1) -> dict[str, Value]:
    """What a repro needs of a setup: each dimension at a value other than its neutral one (the ranks: at least
    ``world_size``, the issue's own smallest, when the scenario names fewer)."""
    out = {d.name: v for d in DIMENSIONS if (v := d.required(sc)) is not None}
    if world_size > int(out.get("world_size", 1)):
        out["world_size"] = world_size
    return out


__all__ = ["BY_NAME", "DIMENSIONS", "Dimension", "Kind", "Value", "requirements"]
