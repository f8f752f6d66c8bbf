"""What DeepSpeed is configured with and the optimizer both sides build: `ds_config` (every
numerics-relevant key explicit, so correct releases agree with the oracle), the parameter groups
(`param_groups`) and the oracle's optimizer (`make_optimizer`)."""

from __future__ import annotations

from typing import Any, TypedDict

import torch
import torch.nn as nn

from zerostate.harness.net.fp16 import Fp16Config
from zerostate.harness.net.torch_network import blocks_of
from zerostate.model.scenario import Family, Offload, Optimizer, Precision, Scenario, Scheduler

BATCH = 2
LR = 0.05
ADAM: dict[str, Any] = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-3, "weight_decay": 0.0}
"""``optimizer: config-adam``: the hyper-parameters DeepSpeed's config and the oracle's ``torch.optim.AdamW`` share.
Adam divides by ``sqrt(v) + eps``: on its first step the update is ``lr * g / (|g| + eps)``, whose sensitivity to a
gradient's rounding error is at most ``lr / eps``.  With Adam's usual eps 1e-8 a gradient that is zero in exact
arithmetic but +-1e-8 after rounding (DeepSpeed and PyTorch sum in different orders, at world size 2) would move
by +-lr.  eps 1e-3 with lr 1e-2 bounds that amplification to 10, while a step's update (about lr per element) stays
far above the fp32 tolerance: a lost or repeated micro-step still shows (DeepSpeed #7967 on 0.18.7: 0.0195).
The gradients here (median 0.06-0.09, 10th percentile 0.01, plain 1- and 3-block networks) are well above eps,
so Adam's step is close to ``lr * sign(g)`` and hides bugs that only scale gradients
(`fp16-scale-increase-halves-step` is not seen with it): half the draws keep the client SGD.  ``weight_decay`` 0
is HF Trainer's default (set explicitly: torch's AdamW would otherwise decay by 0.01, DeepSpeed's FusedAdam by 0);
decay would also differ by design on parameters without a gradient (ZeRO's flat partitions step them with a zero
gradient, PyTorch skips them), on every unused sub-module of every draw."""


class _GroupBase(TypedDict):
    params: list[nn.Parameter]
    lr: float


class ParamGroup(_GroupBase, total=False):
    weight_decay: float


def fp16_section(sc: Scenario) -> Fp16Config:
    """fp16: dynamic loss scaling from 2**loss_scale_power; an overflow skips the step and halves the scale,
    two steps without overflow double it."""
    return {"enabled": True, "loss_scale": 0, "initial_scale_power": sc.loss_scale_power, "loss_scale_window": 2,
            "hysteresis": 1, "min_loss_scale": 1}


def ds_config(sc: Scenario) -> dict[str, Any]:
    """Every numerics-relevant key explicit, so correct releases agree with the oracle."""
    zero: dict[str, Any] = {"stage": sc.stage, "reduce_bucket_size": sc.reduce_bucket_size}
    if sc.stage == 3:
        zero["stage3_param_persistence_threshold"] = sc.persistence_threshold
        zero["stage3_prefetch_bucket_size"] = sc.prefetch_bucket_size
        zero["stage3_max_reuse_distance"] = sc.max_reuse_distance
        zero["stage3_max_live_parameters"] = sc.max_live_parameters
        if sc.all_reduce_fetch:
            zero["stage3_use_all_reduce_for_fetch_params"] = True
        if any(st.save_load for st in sc.steps):  # what HF Trainer saves at ZeRO-3
            zero["stage3_gather_16bit_weights_on_model_save"] = True
    if not sc.contiguous_gradients:
        zero["contiguous_gradients"] = False
    if sc.overlap_comm is not None:
        zero["overlap_comm"] = bool(sc.overlap_comm)
    if not sc.reduce_scatter:
        zero["reduce_scatter"] = False
    if sc.offload in (Offload.OPTIMIZER, Offload.BOTH):
        zero["offload_optimizer"] = {"device": "cpu"}
    if sc.offload in (Offload.PARAM, Offload.BOTH):
        zero["offload_param"] = {"device": "cpu"}
    fp16 = sc.precision is Precision.FP16
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1 if sc.manual_boundary else sc.gas,
        "gradient_clipping": float(sc.gradient_clipping),
        "fp16": fp16_section(sc) if fp16 else {"enabled": False},
        "bf16": {"enabled": sc.precision is Precision.BF16},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if sc.fp32_grad_accum:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if sc.offload is not Offload.NONE:
        cfg["zero_force_ds_cpu_optimizer"] = False  # offload with the client SGD, not DeepSpeedCPUAdam
    if sc.optimizer is Optimizer.CONFIG_ADAM:  # DeepSpeed builds torch's AdamW (torch_adam: no JIT op)
        cfg["optimizer"] = {"type": "AdamW", "params": {**ADAM, "betas": list(ADAM["betas"]), "torch_adam": True}}
    return cfg


def base_lr(sc: Scenario) -> float:
    """The learning rate of parameter group 0: `LR` for SGD, Adam's for ``config-adam``."""
    return float(ADAM["lr"]) if sc.optimizer is Optimizer.CONFIG_ADAM else LR


def make_optimizer(sc: Scenario, groups: list[ParamGroup]) -> torch.optim.Optimizer:
    """The oracle's optimizer over ``groups``: what the engine backend gives DeepSpeed or has it build."""
    if sc.optimizer is Optimizer.CONFIG_ADAM:
        return torch.optim.AdamW(groups, **ADAM)  # type: ignore[arg-type]
    return torch.optim.SGD(groups, lr=LR)  # type: ignore[arg-type]


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def param_groups(sc: Scenario, model: nn.Module) -> list[ParamGroup]:
    """The optimizer's parameter groups: block ``i`` in group ``i % param_groups`` with learning rate
    ``base_lr * (1 + group) / 2**group``, the rest (head, Llama) in group 0; blocks with
    ``in_optimizer: false`` in no group (their parameters still require grad).  ``decay_groups``: HF Trainer's
    two (`decay_groups`)."""
    n, lr = sc.param_groups, base_lr(sc)
    if sc.decay_groups:
        return decay_groups(sc, model)
    if sc.family is Family.LLAMA:
        return [{"params": trainable(model), "lr": lr}]
    groups: list[list[nn.Parameter]] = [[] for _ in range(n)]
    out_of: set[int] = set()
    net = blocks_of(model)
    for i, b in enumerate(sc.blocks):
        ps = [p for p in net.block(i).parameters() if p.requires_grad]
        if not b.in_optimizer:
            out_of.update(id(p) for p in ps)
        else:
            groups[i % n].extend(ps)
    seen = {id(p) for g in groups for p in g} | out_of
    groups[0].extend(p for p in trainable(model) if id(p) not in seen)
    return [{"params": g, "lr": lr * (1 + k) / 2 ** k} for k, g in enumerate(groups) if g]


def decay_groups(sc: Scenario, model: nn.Module) -> list[ParamGroup]:
    """HF Trainer's ``create_optimizer`` groups: the trainable parameters it decays (not a bias, not in a norm:
    transformers' ``get_decay_parameter_names``) and the others, weight decay 0 (HF's default) in both, each passed
    even when empty.  Blocks with ``in_optimizer: false`` stay in no group."""
    out_of = {id(p) for i, b in enumerate(sc.blocks) if not b.in_optimizer and sc.family is Family.BLOCKS
              for p in blocks_of(model).block(i).parameters()}
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for module in model.modules():
        in_norm = "norm" in type(module).__name__.lower()
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in out_of:
                (rest if in_norm or name.endswith("bias") else decay).append(p)
    lr = base_lr(sc)
    return [{"params": decay, "lr": lr, "weight_decay": 0.0}, {"params": rest, "lr": lr, "weight_decay": 0.0}]


def make_scheduler(sc: Scenario, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """``scheduler``'s schedule over ``opt``: HF's ``"linear"`` decay without warmup, ``(T - t) / T`` of each
    group's rate at train step ``t``, ``T`` one more than the scenario's train steps (no rate reaches zero)."""
    if sc.scheduler is Scheduler.NONE:
        return None
    total = len(sc.steps) + 1
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (total - t) / total)


__all__ = ["ADAM", "BATCH", "LR", "ParamGroup", "base_lr", "decay_groups", "ds_config", "fp16_section",
           "make_optimizer", "make_scheduler", "param_groups", "trainable"]
