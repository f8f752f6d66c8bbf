"""The scenario's real network and training loop: torch (and, inside functions, deepspeed) only.

This module imports nothing from zerostate, on purpose: `repro.py` embeds its
source verbatim (``inspect.getsource``) into standalone reproduction scripts,
so the network a finding is reproduced with is byte-for-byte the one the
executor ran.  A *spec* here is the plain dict of ``Scenario.to_dict()``.

* `Net` -- blocks of ``norm`` (LayerNorm) -> ``lin`` (Linear); each block plain,
  reentrant- or non-reentrant-checkpointed; sub-modules trainable, frozen or
  unused; an optional fused head (`FusedHeadLoss`, the TiledFusedLogitsLoss
  pattern: ``torch.autograd.backward`` inside a custom Function's forward, with
  ``head.weight`` not an input tensor of the Function).  Parameter names are
  ``blocks.{i}.norm.weight`` ... ``head.weight``, as in ``zerostate.model.network``.
  Training-setup options (issue 11): ``tie`` (block 0's Linear applied again after the last block),
  ``external`` (the root module uses block 0's Linear weight itself: a ZeRO-3 external parameter),
  ``outputs`` (tuple / dict) and ``losses`` (an auxiliary loss on the ``aux`` output).
* `build_llama` -- the second family: a tiny Hugging Face ``LlamaForCausalLM`` (one decoder layer per
  block, ``tie_word_embeddings`` = ``tie``, HF's own ``gradient_checkpointing_enable``, optional PEFT
  LoRA on ``q_proj``/``v_proj``), called as HF Trainer does: ``model(input_ids=..., labels=...)``.
* `ds_config` -- the DeepSpeed config: every numerics-relevant key is explicit
  (precision, ``gradient_clipping`` -- default 1.0 from 0.19.5, so always written --, offload, SGD
  passed as a client optimizer in `param_groups`, or, ``optimizer: config-adam``, an ``optimizer`` section
  DeepSpeed builds torch's AdamW from, with `param_groups` as ``model_parameters``).
* `tolerance` -- the oracle's tolerance: exact-ish (``ATOL``/``RTOL``) in fp32, offload included;
  ``BF16_ATOL``/``BF16_RTOL`` for bf16 (bf16 parameters have an 8-bit mantissa: one rounding is a
  relative 2**-8 = 0.4 %, a few steps of SGD accumulate a few of them); ``FP16_ATOL``/``FP16_RTOL`` for
  fp16, whose oracle is mixed precision itself (`TorchBackend` with `LossScale`: fp16 forward/backward,
  fp32 master parameters, DeepSpeed's dynamic loss scaling, so an overflow skips the same step).
* `run_engines_before` -- several engines in one process (issue 15, ``engines_before``): before the
  scenario's own engine, `DeepSpeedBackend` builds, trains (one plain train step) and destroys one engine
  per listed ZeRO stage, each on a fresh copy of the network, as TRL builds policy, reference and reward
  models in one process.  Whatever DeepSpeed keeps between engines reaches the scenario's engine.
* `run_schedule` -- the one training loop, parameterised by a `Backend`: the
  DeepSpeed engine (`DeepSpeedBackend`) or plain PyTorch (`TorchBackend`, the
  oracle).  DeepSpeed divides by ``gradient_accumulation_steps`` itself
  (``engine.backward`` scales the loss, the output hooks scale PyTorch-style
  gradients); the oracle divides explicitly.
"""

import os
import warnings

from zerostate.tracing import marks
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

BATCH = 2
LR = 0.05
ATOL = 1e-5
RTOL = 1e-4
BF16_ATOL = 2e-2
BF16_RTOL = 2e-2
FP16_ATOL = 5e-3
FP16_RTOL = 5e-3
VOCAB = 32
SEQ = 4
ADAM = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-3, "weight_decay": 0.0}
"""``optimizer: config-adam``: the hyper-parameters DeepSpeed's config and the oracle's ``torch.optim.AdamW`` share.
Adam divides by ``sqrt(v) + eps``: on its first step the update is ``lr * g / (|g| + eps)``, whose sensitivity to a
gradient's rounding error is at most ``lr / eps``.  With Adam's usual eps 1e-8 a gradient that is zero in exact
arithmetic but +-1e-8 after rounding (DeepSpeed and PyTorch sum in different orders, at world size 2) would move
by +-lr.  eps 1e-3 with lr 1e-2 bounds that amplification to 10, while a step's update (about lr per element) stays
far above the fp32 tolerance: a lost or repeated micro-step still shows (DeepSpeed #7967 on 0.18.7: 0.0195).
Measured: eps 1e-8 gave no false mismatch either (98 drawn fp32 scenarios at world size 1, whose gradients are
bit-identical to the oracle's; 4 at world size 2), so the margin is a precaution.  The gradients here (median
0.06-0.09, 10th percentile 0.01, plain 1- and 3-block networks) are well above eps, so Adam's step is close to
``lr * sign(g)`` and hides bugs that only scale gradients (`fp16-scale-increase-halves-step` is not seen with it,
eps 1e-3 or 1e-8): half the draws keep the client SGD.  ``weight_decay`` 0 is HF Trainer's default (set explicitly:
torch's AdamW would otherwise decay by 0.01, DeepSpeed's FusedAdam by 0); decay would also differ by design on
parameters without a gradient (ZeRO's flat partitions step them with a zero gradient, PyTorch skips them), on
every unused sub-module of every draw (measured with decay 0.01: an unused LayerNorm's weight 2.4e-4 apart after
two steps, ZeRO-2 and 3)."""

# fp16: the current loss scale (a callable) of the backend that runs, which the fused head's backward inside
# forward must apply itself, as any user code calling backward outside the engine must (None: 1).
LOSS_SCALE = None


def _call_block(blk, x, skip_norm):
    obs = marks.BLOCK_OBSERVER
    if obs is not None:
        obs[0](blk)
    try:
        return blk(x, skip_norm=skip_norm)
    finally:
        if obs is not None:
            obs[1](blk)


class Block(nn.Module):
    """x -> lin(norm(x)); a sub-module marked "unused" is skipped by forward."""

    def __init__(self, width, norm_kind, lin_kind):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)
        self.use_norm = norm_kind != "unused"
        self.use_lin = lin_kind != "unused"

    def forward(self, x, skip_norm=False):
        self.norm_skipped = skip_norm  # the tracer reads it: a skipped norm's parameters are not saved
        if self.use_norm and not skip_norm:
            x = self.norm(x)
        if self.use_lin:
            x = self.lin(x)
        return x


class FusedHeadLoss(torch.autograd.Function):
    """A loss that runs its own backward inside forward (TiledFusedLogitsLoss pattern).

    ``head`` is a Module, not an input tensor: its weight's gradient is accumulated during
    *forward*, by ``torch.autograd.backward``, before the user ever calls backward.
    """

    @staticmethod
    def forward(ctx, hidden, head):
        scale = LOSS_SCALE() if LOSS_SCALE is not None else 1.0  # fp16: the head's gradient is loss-scaled
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(True)
            loss = head(h).pow(2).mean()
            obs = marks.PRE_BACKWARD_OBSERVER
            if obs is not None:
                obs[0]()
            torch.autograd.backward(loss * scale if scale != 1.0 else loss)
            if obs is not None:
                obs[1]()
        ctx.save_for_backward(h.grad if scale == 1.0 else h.grad / scale)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        (gh,) = ctx.saved_tensors
        return gh * grad, None


class Net(nn.Module):
    def __init__(self, spec):
        super().__init__()
        w = spec.get("width", 8)
        bl = spec.get("blocks", [{}])
        self.blocks = nn.ModuleList(Block(w, b.get("norm", "trainable"), b.get("lin", "trainable")) for b in bl)
        self.ckpt = [b.get("checkpoint", "none") for b in bl]
        self.head = nn.Linear(w, w, bias=False) if spec.get("fused_head", False) else None
        self.tie = spec.get("tie", False)
        self.external = spec.get("external", False)
        self.outputs = spec.get("outputs", "tensor")
        # registered last: the trailing parameter of every optimizer group (DeepSpeed #8279)
        self.empty = nn.Parameter(torch.zeros(0)) if spec.get("empty_param", False) else None

    def forward(self, x, skip=()):
        """``skip``: blocks whose (frozen) norm this forward skips, a data-dependent branch."""
        grad = torch.is_grad_enabled()
        for i, (blk, ck) in enumerate(zip(self.blocks, self.ckpt)):
            s = i in skip
            if grad and ck == "reentrant":
                x = checkpoint(_call_block, blk, x, s, use_reentrant=True)
            elif grad and ck == "non_reentrant":
                x = checkpoint(_call_block, blk, x, s, use_reentrant=False)
            else:
                x = blk(x, skip_norm=s)
        if self.tie:  # the same Linear module a second time in one forward (a tied embedding / LM head)
            x = self.blocks[0].lin(x)
        if self.external:  # the root module computes with a parameter block 0's Linear owns
            x = x + 0.5 * torch.nn.functional.linear(x, self.blocks[0].lin.weight)
        if "late" in self._modules:  # attached after deepspeed.initialize (`attach_late_module`)
            x = self.late(x)
        if self.empty is not None:  # used in forward: its gradient, of no elements, reaches ZeRO's hooks
            x = x + self.empty.sum()
        aux = x.mean(-1)
        if self.head is not None:
            x = FusedHeadLoss.apply(x, self.head) if grad else self.head(x).pow(2).mean()
        if self.outputs == "tuple":
            return x, aux
        if self.outputs == "dict":
            return {"out": x, "aux": aux}
        return x


def attach_late_module(spec, module):
    """``late_module``: attach a parameterless module to the network after ``deepspeed.initialize`` (both
    backends call it once the model is built or wrapped; the oracle's is a no-op).  DeepSpeed #8009: before
    0.19.1 ZeRO-3's forward hooks meet its plain-dict ``_parameters`` (``'dict' object has no attribute
    '_in_forward'``)."""
    if spec.get("late_module", False):
        module.late = nn.Identity()


def optimizer_built(engine):
    """Which optimizer the engine holds under its ZeRO / precision wrapper (``engine.basic_optimizer``), and
    whether DeepSpeed built it from the config (no client optimizer was passed)."""
    opt = getattr(engine, "basic_optimizer", None)
    return {"class": f"{type(opt).__module__}.{type(opt).__name__}" if opt is not None else None,
            "from_config": getattr(engine, "client_optimizer", None) is None,
            "groups": [{k: v for k, v in g.items() if k in ("lr", "eps", "betas", "weight_decay")}
                       for g in getattr(opt, "param_groups", [])]}


def engine_settings(engine):
    """What the engine itself reports of the settings a scenario chooses (the executor returns it as
    ``engine``): DeepSpeed's own accessors, and for ZeRO-3's all-reduce fetch the flag of the ``zero.Init``
    that converted the parameters (held by each parameter's bound ``all_gather_coalesced``), None if absent."""
    out = {"gradient_accumulation_steps": engine.gradient_accumulation_steps(),
           "contiguous_gradients": bool(engine.zero_contiguous_gradients()),
           "overlap_comm": bool(engine.zero_overlap_comm()),
           "late_module": "late" in engine.module._modules, "world_size": int(engine.world_size),
           "optimizer": optimizer_built(engine)}
    p = next(iter(engine.module.parameters()), None)
    init, fns = None, [getattr(p, "all_gather_coalesced", None)]
    for _ in range(3):  # a closure (inside DeepSpeed's instrument_w_nvtx wrapper) that captured the zero.Init
        cells = [c.cell_contents for fn in fns for c in (getattr(fn, "__closure__", None) or ())]
        init = next((c for c in cells if hasattr(c, "use_all_reduce_for_fetch_params")), None)
        if init is not None:
            break
        fns = [c for c in cells if callable(c)]
    out["all_reduce_fetch"] = getattr(init, "use_all_reduce_for_fetch_params", None)
    return out


def build_llama(spec):
    """A tiny HF Llama (hidden = width, 2 heads, one decoder layer per block), seeded; HF gradient
    checkpointing when the blocks ask for it; wrapped by PEFT LoRA when ``lora``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(spec.get("seed", 0))
    w, bl = spec.get("width", 8), spec.get("blocks", [{}])
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=w, intermediate_size=2 * w, num_hidden_layers=len(bl),
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * SEQ,
                      tie_word_embeddings=spec.get("tie", False), attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    ck = bl[0].get("checkpoint", "none")
    if ck != "none":
        kw = {"use_reentrant": ck == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    model = apply_lora(spec, model)
    model.train()
    return model


def apply_lora(spec, model):
    """PEFT LoRA on q/v projections when ``lora`` (``modules_to_save``: the head too); B drawn non-zero."""
    if not spec.get("lora", False):
        return model
    from peft import LoraConfig, get_peft_model
    save = ["lm_head"] if spec.get("modules_to_save", False) else None  # DeepSpeed #8144
    model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"], modules_to_save=save))
    with torch.no_grad():  # LoRA's B starts at zero; non-zero makes A's gradient non-zero from step 0
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    return model


def build_engine_model(spec):
    """The network DeepSpeed trains: `build_model`'s, or with ``zero_init`` (ZeRO-3) built the way Hugging
    Face's ``from_pretrained`` builds it when ZeRO-3 is configured (`build_zero_init`)."""
    if spec.get("zero_init", False) and spec.get("stage", 3) == 3:
        return build_zero_init(spec)
    return build_model(spec)


def build_zero_init(spec):
    """HF ``from_pretrained`` under ZeRO-3 (``HfDeepSpeedConfig`` / accelerate's ``zero3_init_flag``): the
    modules are constructed inside ``deepspeed.zero.Init(config_dict_or_path=config)`` -- no ``dtype``, as HF
    passes none: the config's bf16/fp16 decides it (an explicit ``dtype`` is ignored on an accelerator
    without fp16, such as the CPU one: ``_set_dtype``'s ``dtype or torch.float16 if ... else torch.bfloat16``
    parses as ``(dtype or fp16) if fp16_supported else bf16``, measured on 0.19.8) -- so each parameter is
    partitioned (and cast) as it is made; the weights are then loaded into the partitioned
    parameters under ``GatheredParameters(modifier_rank=0)``; PEFT's LoRA wraps the model afterwards, so
    its adapters are made outside ``zero.Init`` and stay fp32 (PEFT's ``autocast_adapter_dtype``) while the
    base is bf16/fp16 -- the mix of DeepSpeed #8072/#8073.  The values are `build_model`'s (the oracle's)."""
    import deepspeed
    ref = dict(build_model(spec).named_parameters())
    base = dict(spec, lora=False, modules_to_save=False)
    with deepspeed.zero.Init(config_dict_or_path=ds_config(spec)):
        model = build_model(base)
    model = apply_lora(spec, model)
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            p.data.copy_(ref[name].data)
    model.train()
    return model


def build_model(spec):
    """The network with seeded, non-trivial initial values; frozen parameters have requires_grad False."""
    if spec.get("family", "blocks") == "llama":
        return build_llama(spec)
    torch.manual_seed(spec.get("seed", 0))
    net = Net(spec)
    with torch.no_grad():
        for blk in net.blocks:
            blk.norm.weight.normal_(1.0, 0.2)
            blk.norm.bias.normal_(0.0, 0.2)
    for i, b in enumerate(spec.get("blocks", [{}])):
        for sub in ("norm", "lin"):
            if b.get(sub, "trainable") == "frozen":
                for p in getattr(net.blocks[i], sub).parameters():
                    p.requires_grad_(False)
    return net


def gas_of(spec):
    return len(spec.get("steps", [{}])[0].get("micro", [{}]))


def batch(spec, step, micro, eval_=False):
    g = torch.Generator().manual_seed(1000003 * spec.get("seed", 0) + 1009 * step + 2 * micro + int(eval_))
    if spec.get("family", "blocks") == "llama":
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    x = torch.randn(BATCH, spec.get("width", 8), generator=g)
    if spec.get("input_requires_grad", True) and not eval_:
        x.requires_grad_(True)
    return x


def ds_config(spec):
    """Every numerics-relevant key explicit, so correct releases agree with the oracle."""
    zero = {"stage": spec.get("stage", 3), "reduce_bucket_size": spec.get("reduce_bucket_size", 500_000_000)}
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = spec.get("persistence_threshold", 0)
        zero["stage3_prefetch_bucket_size"] = spec.get("prefetch_bucket_size", 0)
        zero["stage3_max_reuse_distance"] = spec.get("max_reuse_distance", 1_000_000_000)
        zero["stage3_max_live_parameters"] = spec.get("max_live_parameters", 1_000_000_000)
        if spec.get("all_reduce_fetch", False):
            zero["stage3_use_all_reduce_for_fetch_params"] = True
        if any(st.get("save_load", False) for st in spec.get("steps", [{}])):  # what HF Trainer saves at ZeRO-3
            zero["stage3_gather_16bit_weights_on_model_save"] = True
    if not spec.get("contiguous_gradients", True):
        zero["contiguous_gradients"] = False
    if spec.get("overlap_comm") is not None:
        zero["overlap_comm"] = bool(spec["overlap_comm"])
    offload = spec.get("offload", "none")
    if offload in ("optimizer", "both"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload in ("param", "both"):
        zero["offload_param"] = {"device": "cpu"}
    prec = spec.get("precision", "fp32")
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1 if spec.get("manual_boundary", False) else gas_of(spec),
        "gradient_clipping": float(spec.get("gradient_clipping", 0.0)),
        "fp16": {"enabled": prec == "fp16"},
        "bf16": {"enabled": prec == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if prec == "fp16":  # dynamic loss scaling from 2**loss_scale_power (default 8): an overflow skips the step
        # and halves the scale; two steps without overflow double it
        cfg["fp16"].update(loss_scale=0, initial_scale_power=spec.get("loss_scale_power", 8),
                           loss_scale_window=2, hysteresis=1, min_loss_scale=1)
    if spec.get("fp32_grad_accum", False):
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if offload != "none":
        cfg["zero_force_ds_cpu_optimizer"] = False  # offload with the client SGD, not DeepSpeedCPUAdam
    if spec.get("optimizer", "sgd") == "config-adam":  # DeepSpeed builds torch's AdamW (torch_adam: no JIT op)
        cfg["optimizer"] = {"type": "AdamW", "params": {**ADAM, "betas": list(ADAM["betas"]), "torch_adam": True}}
    return cfg


def base_lr(spec):
    """The learning rate of parameter group 0: `LR` for SGD, Adam's for ``config-adam``."""
    return ADAM["lr"] if spec.get("optimizer", "sgd") == "config-adam" else LR


def make_optimizer(spec, groups):
    """The oracle's optimizer over ``groups``: what `DeepSpeedBackend` gives DeepSpeed or has it build."""
    if spec.get("optimizer", "sgd") == "config-adam":
        return torch.optim.AdamW(groups, **ADAM)
    return torch.optim.SGD(groups, lr=LR)


def tolerance(spec):
    """``(atol, rtol)`` of the oracle comparison: fp32 (offload too: the same fp32 arithmetic on the
    CPU) is compared tightly; bf16 parameters are rounded to an 8-bit mantissa (against an fp32 oracle);
    fp16 ones to an 11-bit mantissa (one rounding: a relative 2**-11 = 0.05 %), against an oracle that
    runs the same fp16 forward and backward (only the order of DeepSpeed's sums differs): 5e-3."""
    prec = spec.get("precision", "fp32")
    if prec == "fp16":
        return FP16_ATOL, FP16_RTOL
    if prec == "bf16":
        return BF16_ATOL, BF16_RTOL
    return ATOL, RTOL


def param_groups(spec, model):
    """The client optimizer's parameter groups: block ``i`` in group ``i % param_groups`` with learning
    rate ``base_lr * (1 + group) / 2**group``, the rest (head, Llama) in group 0; blocks with
    ``in_optimizer: false`` in no group (their parameters still require grad)."""
    n, lr = spec.get("param_groups", 1), base_lr(spec)
    if spec.get("family", "blocks") == "llama":
        return [{"params": trainable(model), "lr": lr}]
    groups = [[] for _ in range(n)]
    out_of = set()
    for i, b in enumerate(spec.get("blocks", [{}])):
        ps = [p for p in model.blocks[i].parameters() if p.requires_grad]
        if not b.get("in_optimizer", True):
            out_of.update(id(p) for p in ps)
        else:
            groups[i % n].extend(ps)
    seen = {id(p) for g in groups for p in g} | out_of
    groups[0].extend(p for p in trainable(model) if id(p) not in seen)
    return [{"params": g, "lr": lr * (1 + k) / 2 ** k} for k, g in enumerate(groups) if g]


def optimized(spec, model):
    """The parameters the optimizer holds (what gradient clipping's norm is taken over)."""
    return [p for g in param_groups(spec, model) for p in g["params"]]


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


class LossScale:
    """DeepSpeed's dynamic loss scaler (runtime/fp16/loss_scaler.py ``DynamicLossScaler.update_scale``) for
    the config `ds_config` writes: ``hysteresis`` 1, factor 2, ``consecutive_hysteresis`` off.  An overflow
    (a non-finite gradient) skips the step and halves the scale (not below ``min_loss_scale``); after
    ``loss_scale_window`` steps without overflow it doubles."""

    def __init__(self, cfg):
        self.scale = float(2 ** cfg["initial_scale_power"])
        self.window, self.min = cfg["loss_scale_window"], cfg["min_loss_scale"]
        self.iter, self.last_overflow = 0, -1
        self.skipped = []  # the train steps skipped for an overflow
        self.scales = []  # the scale each train step ran with

    def update(self, overflow, step):
        self.scales.append(self.scale)
        if overflow:
            self.skipped.append(step)
            self.scale = max(self.scale / 2, self.min)
            self.last_overflow = self.iter
        else:
            stable = self.iter - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.scale *= 2
        self.iter += 1


class TorchBackend:
    """The oracle: the same network and schedule with plain PyTorch and the same optimizer.

    fp16 (mixed precision as DeepSpeed does it, with its dynamic loss scaling, `LossScale`): ``model`` is
    the fp32 master copy the optimizer updates and `params` returns; forward and backward run on an fp16
    copy of it with the loss multiplied by the current scale; at the step boundary a non-finite fp16
    gradient skips the step (the scale halves), otherwise the gradients are unscaled into fp32, clipped,
    the master parameters stepped and copied back into the fp16 copy."""

    def __init__(self, spec, model):
        self.master, self.gas = model, gas_of(spec)
        self.clip = float(spec.get("gradient_clipping", 0.0))
        self.opt = make_optimizer(spec, param_groups(spec, model))
        self.llama = spec.get("family", "blocks") == "llama"
        self.scaler = None
        self.model = model
        self.steps = 0
        self.stage = spec.get("stage", 3)
        self.generated: list = []
        """The output of each generation (`reregister`), this rank's rows."""
        if spec.get("precision", "fp32") == "fp16":
            import copy
            global LOSS_SCALE
            self.model = copy.deepcopy(model).half()
            self.scaler = LossScale(ds_config(spec)["fp16"])
            LOSS_SCALE = lambda: self.scaler.scale  # noqa: E731
        attach_late_module(spec, self.model)

    def _input(self, x):
        if self.scaler is not None and x.is_floating_point():
            x = x.detach().half().requires_grad_(x.requires_grad)
        return x

    def forward(self, x, skip=()):
        x = self._input(x)
        if self.llama:
            return self.model(input_ids=x, labels=x)
        return self.model(x, skip=tuple(skip)) if skip else self.model(x)

    def reregister(self, x=None):
        """Plain PyTorch has no hooks to remove: only the generation of TRL's unwrap (ZeRO-3, as the engine
        side does it), whose output this rank's share of is kept (``generated``) to compare with DeepSpeed's."""
        if x is None or self.stage != 3:
            return
        self.generated.append(rows_share(generation_output(self.eval_forward(x))))

    def save_load(self, step):
        return None  # the oracle is unchanged: a checkpoint round trip must not change training

    def eval_forward(self, x):
        return no_grad_forward(self.model, self._input(x), self.llama)

    def backward(self, kind, out, loss, fused, part=1.0, keep=False):
        """``part``: the share of the loss this backward takes; ``keep``: retain_graph (two backwards)."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if kind == "nonscalar":
            g = torch.ones_like(loss) if fused else (2 * out / out.numel()).detach()
            (loss if fused else out).backward(gradient=part * g / self.gas * scale, retain_graph=keep)
        else:
            (part * loss / self.gas * scale if scale != 1.0 else part * loss / self.gas).backward(retain_graph=keep)

    def boundary(self, boundary):
        pass  # plain PyTorch: the step boundary is where the loop calls the optimizer

    def micro_done(self, boundary):
        if not boundary:
            return
        if self.scaler is not None:
            grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
            # DeepSpeed checks the gradients of the parameters its optimizer holds: a parameter in no group
            # (``in_optimizer: false``) may overflow without skipping the step
            held = {id(q) for g in self.opt.param_groups for q in g["params"]}
            overflow = any(not torch.isfinite(grads[n]).all() for n, p in self.master.named_parameters()
                           if id(p) in held and n in grads)
            for n, p in self.master.named_parameters():
                p.grad = None if overflow or n not in grads else grads[n].float() / self.scaler.scale
            self.model.zero_grad(set_to_none=True)
            self.scaler.update(overflow, self.steps)
            self.steps += 1
            if overflow:  # the step is skipped
                return
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.scaler is not None:
            with torch.no_grad():
                for p, q in zip(self.master.parameters(), self.model.parameters()):
                    q.copy_(p)

    def params(self):
        return {n: p.detach().clone() for n, p in self.master.named_parameters()}


def rank_of():
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def barrier():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shared_tmpdir():
    """A temporary directory every rank uses (rank 0 makes it and sends its path): a DeepSpeed checkpoint
    is one directory, rank 0's model states read by every rank at load."""
    import tempfile
    import torch.distributed as dist
    path = [tempfile.mkdtemp(prefix="zerostate-ckpt-") if not rank_of() else None]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(path, src=0)
    return path[0]


def fp32_from_zero_checkpoint(path):
    """The fp32 weights DeepSpeed's ``zero_to_fp32`` rebuilds from a ZeRO checkpoint
    (``get_fp32_state_dict_from_zero_checkpoint``, what users convert a checkpoint with); its prints are
    silenced.  The 0.19.8 engine saves the shapes of parameters the optimizer does not own (a parameter in
    no group, a zero-element one) with the frozen ones: before, only ``requires_grad=False`` ones."""
    import contextlib
    import io
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with contextlib.redirect_stdout(io.StringIO()):
        return {k: v.detach().cpu().clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(path).items()}


def max_abs(t) -> float:
    """The largest |element| of ``t``; 0 for a tensor with no elements (``empty_param``)."""
    return t.abs().max().item() if t.numel() else 0.0


def no_grad_forward(module, x, llama):
    """One forward of ``module`` in eval mode without autograd (an eval forward, a generation), its output."""
    module.eval()
    with torch.no_grad():
        out = module(input_ids=x) if llama else module(x)
    module.train()
    return out


def generation_output(res):
    """The tensor a generation forward produced: a llama's logits, the blocks network's main output."""
    if hasattr(res, "logits"):
        return res.logits.detach()
    if isinstance(res, dict):
        return res["out"].detach()
    return (res[0] if isinstance(res, tuple) else res).detach()


def rows_share(out):
    """This rank's share of the oracle's output of the whole batch: its rows; None for a scalar (a fused
    head's loss) at world size > 1, which each rank computes over its own rows only (not compared)."""
    if out.dim() == 0:
        return None if _world_size() > 1 else out.float()
    return rank_rows(out).float()


def _world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def compare_generated(expected, actual, atol, rtol):
    """None when each generation's output agrees with the oracle's (its share: `rows_share`; None: not
    compared); else ``(i, sentence)``: the first that does not (i: its index among the scenario's
    re-registrations)."""
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e is None:
            continue
        if a.shape != e.shape:
            return i, f"output shape {tuple(a.shape)} in DeepSpeed vs {tuple(e.shape)} in PyTorch"
        err, lim = max_abs(a - e), atol + rtol * max_abs(e)
        if not err <= lim:  # NaN too
            return i, f"max |DeepSpeed - PyTorch| of the output = {err:.3g} > tolerance {lim:.3g}"
    if len(expected) != len(actual):
        return min(len(expected), len(actual)), f"{len(actual)} generation(s) in DeepSpeed vs {len(expected)} in PyTorch"
    return None


def rank_rows(x):
    """This rank's rows of the global batch (world size > 1; else ``x``).  The oracle trains on the whole
    batch; each rank's loss is the mean over its equal share, and data-parallel averaging of the gradients
    makes the mean of the per-rank means: the gradient of the global batch's mean."""
    import torch.distributed as dist
    ws = _world_size()
    if ws == 1:
        return x
    rank = dist.get_rank()
    if x.shape[0] % ws:
        raise ValueError(f"batch of {x.shape[0]} rows cannot be split evenly over {ws} ranks")
    return x.detach().chunk(ws)[rank].clone().requires_grad_(x.requires_grad)


def engine_before_spec(spec, stage):
    """The spec of an engine that runs before the scenario's own (``engines_before``): the same network
    (z3 leaf flags cleared) and setup with ZeRO ``stage``, one plain train step of ``gas`` engine.backward
    calls, no engines before it."""
    sub = {k: v for k, v in spec.items() if k != "engines_before"}
    sub["stage"] = stage
    sub["blocks"] = [{k: v for k, v in b.items() if k != "leaf"} for b in spec.get("blocks", [{}])]
    sub["steps"] = [{"micro": [{"backward": "engine"} for _ in range(gas_of(spec))]}]
    if stage != 3 and sub.get("offload") in ("param", "both"):
        sub["offload"] = "optimizer" if sub["offload"] == "both" else "none"
    return sub


def run_engines_before(spec):
    """Build, train one plain step and destroy one engine per stage of ``spec["engines_before"]``, in order,
    in this process.  Returns one line per engine: ``"ZeRO-k: ok"`` or ``"ZeRO-k: ExcType: message"`` -- an
    engine before that raises is part of the process's history like any other (its own bug is found when
    its scenario is explored as the main one), so the next engine still runs."""
    done = []
    for stage in spec.get("engines_before", ()):
        sub = engine_before_spec(spec, stage)
        backend = None
        try:
            backend = DeepSpeedBackend(sub, build_engine_model(sub))
            run_schedule(sub, backend)
            done.append(f"ZeRO-{stage}: ok")
        except Exception as exc:
            done.append(f"ZeRO-{stage}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        finally:
            if backend is not None:
                backend.close()
    return done


def carried_state(stage):
    """Process-wide state an earlier engine left that this (not ZeRO-3) engine runs with, as a sentence, or
    None.  A ZeRO-3 engine replaces ``torch.nn.functional.linear`` by ``zero3_linear_wrap``
    (partition_parameters.py ``_enable_mem_efficient_linear``) and ``destroy()`` does not put it back."""
    fn = torch.nn.functional.linear
    if stage != 3 and "deepspeed" in getattr(fn, "__module__", ""):
        return (f"torch.nn.functional.linear is DeepSpeed's {getattr(fn, '__name__', fn)} while this ZeRO-{stage} "
                "engine runs: left in place by a ZeRO-3 engine destroyed before it in this process")
    return None


def allow_fp16_on_cpu():
    """zerostate's one change to DeepSpeed, made only for an fp16 scenario on DeepSpeed's CPU accelerator:
    that accelerator says fp16 is supported only when oneDNN has AVX512-FP16
    (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``, accelerator/cpu_accelerator.py ``is_fp16_supported``),
    and ``deepspeed.initialize`` refuses fp16 otherwise (engine.py: "fp16 is not supported on this
    accelerator").  That is a speed statement: torch computes float16 on any CPU (emulated, slower), and the
    fp16 path under test -- the loss scaler, the overflow check, ZeRO's fp16 parameters and fp32 master
    partitions -- is device-independent Python.  So the accelerator instance is told fp16 is supported
    (``is_fp16_supported`` and ``supported_dtypes``); nothing else of DeepSpeed changes.  Returns True when it
    made the change (False on a GPU, or on a CPU that has fp16).  `restore_fp16_support` undoes it: the
    executor does after every example, so no other scenario runs with it (zero.Init's default dtype, for
    one, follows ``is_fp16_supported``)."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() != "cpu" or acc.is_fp16_supported():
        return False
    dtypes = acc.supported_dtypes
    acc.is_fp16_supported = lambda: True
    acc.supported_dtypes = lambda: list(dtypes()) + [torch.float16]
    return True


def restore_fp16_support():
    """Undo `allow_fp16_on_cpu` (the class's own methods again); True when there was something to undo."""
    import sys
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    changed = False
    for name in ("is_fp16_supported", "supported_dtypes"):
        if name in vars(acc):
            delattr(acc, name)
            changed = True
    return changed


class DeepSpeedBackend:
    """The real engine: ``deepspeed.initialize`` with ZeRO 1/2/3 and a client SGD optimizer (or, ``config-adam``,
    the optimizer DeepSpeed builds from the config over the same groups).  With
    ``engines_before`` in the spec, those engines run first (`run_engines_before`)."""

    def __init__(self, spec, model):
        import deepspeed
        self.spec = spec
        if spec.get("precision", "fp32") == "fp16":
            allow_fp16_on_cpu()
        self.engines_before = run_engines_before(spec)
        self.carried = carried_state(spec.get("stage", 3))
        if spec.get("stage", 3) == 3:
            from deepspeed.utils import set_z3_leaf_module
            for i, b in enumerate(spec.get("blocks", [{}])):
                if b.get("leaf", False):
                    set_z3_leaf_module(model.blocks[i], True)
        if spec.get("optimizer", "sgd") == "config-adam":  # DeepSpeed builds it from the config, over these groups
            self.engine, self.opt, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(spec, model),
                                                               config=ds_config(spec))
        else:
            opt = torch.optim.SGD(param_groups(spec, model), lr=LR)
            self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(spec))
        if spec.get("precision", "fp32") == "fp16":
            global LOSS_SCALE
            LOSS_SCALE = lambda: float(self.engine.optimizer.loss_scale)  # noqa: E731
        attach_late_module(spec, self.engine.module)
        self.names = {id(p): n for n, p in self.engine.module.named_parameters()}
        self.llama = spec.get("family", "blocks") == "llama"
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.get("precision", "fp32"))
        self.unwrapped: list[int] = []
        """Per ``reregister`` (TRL's unwrap for generation): the parameters available while generating."""
        self.generated: list = []
        """Per ``reregister``: what the unhooked module generated (compared with the oracle's)."""
        self.manual = bool(spec.get("manual_boundary", False))
        self.share = 1.0 / gas_of(spec) if self.manual else 1.0
        """``manual_boundary``: the engine's gradient_accumulation_steps is 1, so the loop divides each loss
        by ``gas`` itself (what the engine does at gas > 1)."""

    def _input(self, x):
        x = rank_rows(x)
        if self.dtype is not None and x.is_floating_point():  # the engine casts the module, not its input
            x = x.detach().to(self.dtype).requires_grad_(x.requires_grad)
        if x.device != self.engine.device:
            x = x.detach().to(self.engine.device).requires_grad_(x.requires_grad)
        return x

    def forward(self, x, skip=()):
        x = self._input(x)
        if self.llama:
            return self.engine(input_ids=x, labels=x)
        return self.engine(x, skip=tuple(skip)) if skip else self.engine(x)

    def reregister(self, x=None):
        """TRL's ``unwrap_model_for_generation`` at ZeRO-3 (``gather_deepspeed3_params``, its default): every
        parameter gathered (``GatheredParameters``), ZeRO-3's module hooks removed (``remove_hooks``), the
        unwrapped module generating -- here one no-grad forward of ``x`` in eval mode, without hooks --, the
        hooks registered again (``add_hooks``), the parameters released when the gather ends."""
        off = getattr(self.engine.optimizer, "parameter_offload", None)
        if off is None:
            return
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(self.engine.module.parameters())):
            for p in self.engine.module.parameters():
                if hasattr(p, "ds_active_sub_modules"):
                    p.ds_active_sub_modules.clear()
            for h in off.forward_hooks + off.backward_hooks:
                h.remove()
            off.forward_hooks, off.backward_hooks = [], []
            if x is not None:
                self._generate(x)
            off._register_deepspeed_module(off.module)

    def _generate(self, x):
        module = self.engine.module
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        self.unwrapped.append(sum(getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE
                                  for p in module.parameters()))  # gathered while generating (the executor reports it)
        self.generated.append(generation_output(no_grad_forward(module, self._input(x), self.llama)).float())

    def eval_forward(self, x):
        no_grad_forward(self.engine, self._input(x), self.llama)

    def boundary(self, boundary):
        """Before a micro-step's backward: ``manual_boundary`` tells the engine whether it is the last one."""
        if self.manual:
            self.engine.set_gradient_accumulation_boundary(boundary)

    def backward(self, kind, out, loss, fused, part=1.0, keep=False):
        part *= self.share
        if kind == "engine":
            if keep:
                self.engine.backward(part * loss, retain_graph=True)
            else:
                self.engine.backward(loss if part == 1.0 else part * loss)
        elif kind == "torch":
            loss = loss if part == 1.0 else part * loss
            if self.dtype is torch.float16:  # DeepSpeed's API for a PyTorch-style backward with a loss scaler
                loss = self.engine.scale(loss)
            loss.backward(retain_graph=keep)
        else:
            g = torch.ones_like(loss) if fused else (2 * out / out.numel()).detach()
            (loss if fused else out).backward(gradient=g if part == 1.0 else part * g, retain_graph=keep)

    def micro_done(self, boundary):
        if self.manual and not boundary:
            return  # manual boundary: one engine.step() per train step, after the last backward
        self.engine.step()  # DeepSpeed's loop: step() after every micro-step; it updates at the boundary

    def params(self):
        out = {}
        for n, p in self.engine.module.named_parameters():
            if hasattr(p, "ds_tensor") and getattr(getattr(p, "ds_status", None), "name", "") == "AVAILABLE":
                out[n] = p.detach().cpu().clone()  # gathered (persistent): GatheredParameters would partition it
            elif hasattr(p, "ds_tensor"):  # ZeRO-3: read the (world size 1: whole) partition
                import deepspeed
                with deepspeed.zero.GatheredParameters([p]):
                    out[n] = p.detach().cpu().clone()
            else:
                out[n] = p.detach().cpu().clone()
        return out

    def save_load(self, step):
        """``save_load``: what HF Trainer does every ``save_steps`` and on ``--resume_from_checkpoint``, into
        the same engine.  At ZeRO-3 first the consolidated 16-bit state dict
        (``engine._zero3_consolidated_16bit_state_dict()``, what Accelerate's ``get_state_dict`` -- HF
        Trainer's model save -- calls: a ``GatheredParameters`` per module), then
        ``engine.save_checkpoint(dir)`` and ``engine.load_checkpoint(dir)``; the directory is shared by the
        ranks and removed.  Returns a record for `compare_save_load`: the parameters before and after, the
        16-bit state dict, the files written, the loaded path, the engine's step counters and loss scale."""
        import shutil
        rec = {"step": step, "before": self.params(), "counters": [self._counters()]}
        if getattr(self.engine, "zero_optimization_partition_weights", lambda: False)():
            sd = self.engine._zero3_consolidated_16bit_state_dict()  # every rank gathers; rank 0 gets it
            if sd is not None:
                rec["state16"] = {k: v.detach().cpu().clone() for k, v in sd.items()}
        path = shared_tmpdir()
        try:
            self.engine.save_checkpoint(path)
            barrier()  # every rank's files are written
            rec["files"] = sorted(os.path.relpath(os.path.join(d, f), path)
                                  for d, _, fs in os.walk(path) for f in fs)
            if self.spec.get("stage", 3) > 0:
                rec["fp32"] = fp32_from_zero_checkpoint(path)
            rec["loaded"], _ = self.engine.load_checkpoint(path)
        finally:
            barrier()
            if not rank_of():
                shutil.rmtree(path, ignore_errors=True)
        rec["after"] = self.params()
        rec["counters"].append(self._counters())
        rec["fp32_exact"] = self.dtype is None
        return rec

    def _counters(self):
        """The engine state a checkpoint round trip must keep: global / skipped steps, fp16's loss scale."""
        scale = getattr(self.engine.optimizer, "loss_scale", None) if self.dtype is torch.float16 else None
        return {"global_steps": int(self.engine.global_steps), "skipped_steps": int(self.engine.skipped_steps),
                "loss_scale": None if scale is None else float(scale)}

    def fp16_state(self):
        """fp16: the train steps DeepSpeed skipped so far and its current loss scale, else None."""
        if self.dtype is not torch.float16 or self.engine is None:
            return None
        return {"skipped_steps": int(self.engine.skipped_steps), "loss_scale": float(self.engine.optimizer.loss_scale)}

    def close(self):
        global LOSS_SCALE
        LOSS_SCALE = None
        eng = getattr(self, "engine", None)
        if eng is not None and hasattr(eng, "destroy"):
            try:
                eng.destroy()
            except Exception:
                pass
        self.engine = None


def run_schedule(spec, backend, mark=None, after_step=None):
    """The training loop.  ``mark(what, **info)`` observes schedule points; ``after_step(i)`` runs after
    each train step's boundary ``engine.step()``."""
    mark = mark or (lambda what, **info: None)
    fused = spec.get("fused_head", False)
    steps = spec.get("steps", [{}])
    gas = gas_of(spec)
    llama = spec.get("family", "blocks") == "llama"
    for si, st in enumerate(steps):
        if st.get("save_load", False):  # a checkpoint saved and loaded after the previous step (HF Trainer)
            mark("save_load_start", step=si)
            record = backend.save_load(si)
            mark("save_load_end", step=si, record=record)
        if st.get("reregister", False):
            mark("reregister")
            backend.reregister(batch(spec, si, 0, eval_=True))
        if st.get("eval_before", False):
            mark("eval_start")
            backend.eval_forward(batch(spec, si, 0, eval_=True))
            mark("eval_end")
        frozen = [p for b in st.get("frozen", ()) for p in backend_blocks(backend)[b].lin.parameters()]
        for p in frozen:  # requires_grad changed for this step only
            p.requires_grad_(False)
        for mi, m in enumerate(st.get("micro", [{}])):
            boundary = mi == gas - 1
            if st.get("idle", False):  # engine.step() without any forward or backward
                backend.boundary(boundary)
                if boundary:
                    mark("step", step=si)
                backend.micro_done(boundary)
                continue
            kind = m.get("backward", "engine")
            x = batch(spec, si, mi)
            mark("forward_start")
            res = backend.forward(x, m.get("skip", ()))
            mark("forward_end")
            if llama:
                out = loss = res.loss
            else:
                out, aux = (res["out"], res["aux"]) if isinstance(res, dict) else \
                    res if isinstance(res, tuple) else (res, None)
                loss = out if fused else out.pow(2).mean()
                if spec.get("losses", 1) == 2:  # an auxiliary loss (on the hidden state's own output if none)
                    # a fused head's output is already its scalar loss: the auxiliary term on it is linear,
                    # since the square of one rank's mean is not the mean over the ranks (the oracle trains
                    # on the global batch, data parallelism averages the ranks' gradients: issue 15, ws 2)
                    loss = loss + (0.1 * out if fused and aux is None else
                                   0.1 * (out if aux is None else aux).pow(2).mean())
            backend.boundary(boundary)
            for part, keep in (((0.5, True), (0.5, False)) if m.get("retain", False) else ((1.0, False),)):
                mark("backward_start", kind=kind)
                backend.backward(kind, out, loss, fused, part, keep)
                mark("backward_end", kind=kind)
            if boundary:
                mark("step", step=si)
            backend.micro_done(boundary)
        for p in frozen:
            p.requires_grad_(True)
        if after_step is not None:
            after_step(si)


def backend_blocks(backend):
    """The blocks of the module a backend trains (the DeepSpeed engine wraps it)."""
    return (backend.engine.module if hasattr(backend, "engine") else backend.model).blocks


UPDATE_RATIO = (0.5, 2.0)
"""Mixed precision: the bounds of ``|DeepSpeed's update| / |PyTorch's update|`` (`compare_update`)."""


def compare_update(initial_pt, expected, initial_ds, actual, eps):
    """Mixed precision (bf16 / fp16): the norm of the whole update since the start, over every parameter,
    DeepSpeed's against PyTorch's.  The per-element tolerance of `compare` must absorb bf16's rounding of
    each parameter (about ``eps * |p|``), which is as large as a step's update here, so an engine that
    applies a twentieth of the update (DeepSpeed #7839, ZeRO-0 bf16 on 0.18.4-0.18.5: 0.05 of it) still
    passes it; the update's norm over all parameters is not hidden that way.  Checked when PyTorch's update
    is above twice the bound on the rounding noise of DeepSpeed's parameters at both ends (``eps * |params|``,
    ``eps`` half a unit in the last place: the noise's norm is about 0.8 of it);
    None when the ratio is inside `UPDATE_RATIO` (measured on 0.19.8, six bf16 / fp16 scenarios at ZeRO 0-3,
    llama + LoRA among them: 0.999-1.040)."""
    import math
    num = den = noise = 0.0
    for n, e in expected.items():
        a = actual.get(n)
        if a is None or n not in initial_pt or n not in initial_ds or a.shape != e.shape:
            continue
        num += (a.float() - initial_ds[n].float()).pow(2).sum().item()
        den += (e.float() - initial_pt[n].float()).pow(2).sum().item()
        noise += e.float().pow(2).sum().item()
    num, den, noise = math.sqrt(num), math.sqrt(den), eps * math.sqrt(noise)
    if den <= 2 * noise:
        return None
    ratio = num / den
    if UPDATE_RATIO[0] <= ratio <= UPDATE_RATIO[1]:
        return None
    return (f"the update's norm over all parameters: DeepSpeed {num:.3g}, PyTorch {den:.3g} (ratio {ratio:.3g}, "
            f"outside [{UPDATE_RATIO[0]}, {UPDATE_RATIO[1]}])")


def compare(expected, actual, atol=ATOL, rtol=RTOL, names=("PyTorch", "DeepSpeed")):
    """None when every parameter agrees; else a sentence naming the worst parameter (``names``: what the two
    sides are called in it)."""
    worst = None
    for n, e in expected.items():
        a = actual.get(n)
        if a is None or a.shape != e.shape:
            return f"{n}: shape {tuple(e.shape)} in {names[0]} vs {None if a is None else tuple(a.shape)} in {names[1]}"
        err = max_abs(a.float() - e.float())
        lim = atol + rtol * max_abs(e.float())
        if err > lim and (worst is None or err > worst[1]):
            worst = (n, err, lim)
    if worst:
        return f"{worst[0]}: max |{names[1]} - {names[0]}| = {worst[1]:.3g} > tolerance {worst[2]:.3g}"
    return None


def compare_save_load(rec, expected, tol):
    """A checkpoint round trip (`DeepSpeedBackend.save_load`): None, or ``(code, sentence)`` for the first of
    these that fails.  ``expected``: the oracle's parameters at that point (before the step), or None when the
    training already disagrees with the oracle (its own finding says so; the checkpoint is then judged against
    the engine alone, so a divergence is not reported twice).

    * ``no-files`` / ``not-loaded``: ``save_checkpoint`` wrote nothing, ``load_checkpoint`` found nothing;
    * ``16-bit-state-dict`` (ZeRO-3): the consolidated 16-bit state dict exactly against the engine's own
      parameters (it is a copy of them), and against the oracle (``tol``);
    * ``round-trip``: after the load, the parameters are exactly what they were before the save;
    * ``counters``: so are the engine's global / skipped steps and fp16's loss scale (a round trip must
      not change training);
    * ``zero-to-fp32`` (ZeRO-1/2/3): the fp32 weights ``zero_to_fp32`` rebuilds from the checkpoint against
      the engine's parameters (exactly in fp32 training; at ``tol`` in bf16 / fp16, whose fp32 master copies
      differ from the 16-bit parameters by a rounding) and against the oracle (``tol``)."""
    where = f"checkpoint before train step {rec['step']}"
    own = ("the engine", "the checkpoint")
    if not rec.get("files"):
        return "no-files", f"{where}: save_checkpoint wrote no file"
    if not rec.get("loaded"):
        return "not-loaded", f"{where}: load_checkpoint loaded nothing (returned {rec.get('loaded')!r})"
    if "state16" in rec:
        msg = compare(rec["before"], rec["state16"], 0.0, 0.0, own) or (
            expected is not None and compare(expected, rec["state16"], *tol))
        if msg:
            return "16-bit-state-dict", f"{where}: the consolidated 16-bit state dict: {msg}"
    msg = compare(rec["before"], rec["after"], 0.0, 0.0, ("the engine before save_checkpoint",
                                                          "the engine after load_checkpoint"))
    if msg:
        return "round-trip", f"{where}: the parameters after load_checkpoint: {msg}"
    if rec["counters"][0] != rec["counters"][1]:
        return "counters", (f"{where}: the engine's counters before save / after load: {rec['counters'][0]} / "
                            f"{rec['counters'][1]}")
    if "fp32" in rec:
        msg = compare(rec["before"], rec["fp32"], *((0.0, 0.0) if rec.get("fp32_exact") else tol), own) or (
            expected is not None and compare(expected, rec["fp32"], *tol))
        if msg:
            return "zero-to-fp32", f"{where}: the fp32 weights zero_to_fp32 rebuilds from the checkpoint: {msg}"
    return None


def oracle_params(spec, info=None):
    """Parameters after each train step, trained with plain PyTorch.  ``info`` (a dict): ``initial``, the
    parameters before training; fp16: ``skipped`` (the train steps the loss scaler skipped) and ``scales``
    (the scale each step ran with)."""
    global LOSS_SCALE
    model = build_model(spec)
    if info is not None:
        info["initial"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        be = TorchBackend(spec, model)
        out = []
        run_schedule(spec, be, after_step=lambda i: out.append(be.params()))
    finally:
        LOSS_SCALE = None
    if info is not None and be.scaler is not None:
        info.update(skipped=be.scaler.skipped, scales=be.scaler.scales)
    if info is not None:
        info["generated"] = be.generated
    return out


def setup_distributed():
    """World size 1 on CPU (gloo) unless launched by the deepspeed launcher / on a GPU (nccl)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    warnings.filterwarnings("ignore")
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
