"""The value types a `Scenario`'s fields hold: the enums of its knobs, a network's `Block`, and the schedule's
`TrainStep` and `MicroStep`.  Plain immutable values; `zerostate.model.scenario` validates and parses them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Checkpoint(str, Enum):
    """How a block is wrapped in ``torch.utils.checkpoint``."""

    NONE = "none"
    """Plain: activations are stored; the block's backward runs in the outer graph task."""
    REENTRANT = "reentrant"
    """``use_reentrant=True``: forward under no_grad; backward re-runs forward and a *nested* backward."""
    NON_REENTRANT = "non_reentrant"
    """``use_reentrant=False``: saved-tensor hooks; recompute on first unpack, in the outer graph task."""


class ParamKind(str, Enum):
    """What a sub-module's parameters are to the optimizer and to autograd."""

    TRAINABLE = "trainable"
    """``requires_grad=True`` and used in forward: one gradient hook per tensor per backward."""
    FROZEN = "frozen"
    """``requires_grad=False``: no gradient hook; saved by non-reentrant checkpoint as a live reference."""
    UNUSED = "unused"
    """``requires_grad=True`` but skipped by forward: no gradient hook fires, not counted as used."""


class BackwardKind(str, Enum):
    """How the user starts backward for one micro-step."""

    ENGINE = "engine"
    """``engine.backward(loss)``: the engine runs the epilogue itself after ``loss.backward()`` returns."""
    TORCH = "torch"
    """``loss.backward()`` directly (PyTorch-style): the engine only sees it through output hooks."""
    NONSCALAR = "nonscalar"
    """``out.backward(gradient=g)`` on a non-scalar output (also PyTorch-style)."""

    @property
    def pytorch_style(self) -> bool:
        return self is not BackwardKind.ENGINE


class Precision(str, Enum):
    """The engine's training precision (``fp16`` / ``bf16`` config sections)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    """Dynamic loss scaling: an overflow skips the step."""


class Offload(str, Enum):
    """ZeRO CPU offload (``offload_optimizer`` / ``offload_param``; parameters: ZeRO-3 only)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    PARAM = "param"
    BOTH = "both"


class Outputs(str, Enum):
    """What the network's forward returns: the hidden state, or ``(hidden, aux)`` / ``{"out", "aux"}``."""

    TENSOR = "tensor"
    TUPLE = "tuple"
    DICT = "dict"


class Family(str, Enum):
    """Which network the blocks describe."""

    BLOCKS = "blocks"
    """``LayerNorm -> Linear`` blocks (`Block`), the network zerostate's model represents."""
    LLAMA = "llama"
    """A tiny Hugging Face ``LlamaForCausalLM``: one decoder layer per block (the blocks' checkpoint mode
    is HF's ``gradient_checkpointing_enable(use_reentrant=...)``; the other block fields stay default)."""


class Optimizer(str, Enum):
    """Who builds the optimizer, and which one."""

    SGD = "sgd"
    """A client ``torch.optim.SGD`` passed to ``deepspeed.initialize(optimizer=...)`` (the default)."""
    CONFIG_ADAM = "config-adam"
    """DeepSpeed builds it from the config (``"optimizer": {"type": "AdamW", "params": {..., "torch_adam":
    true}}``, as HF Trainer writes it), from the parameter groups passed as ``model_parameters``: torch's
    ``AdamW`` (no JIT-built op)."""


class Scheduler(str, Enum):
    """A learning-rate schedule over the optimizer, as trainers run one: HF's default ``"linear"`` decay (no warmup,
    ``lr * (T - t) / T`` with ``T`` one more than the train steps, so no step's rate is zero)."""

    NONE = "none"
    INITIALIZE = "initialize"
    """Passed to ``deepspeed.initialize(lr_scheduler=...)`` (a callable of the optimizer when DeepSpeed builds it,
    as HF Trainer passes it): the engine steps it in ``engine.step()`` at each boundary whose optimizer step was
    applied (an fp16 overflow skips both)."""
    USER = "user"
    """The loop calls ``scheduler.step()`` after each boundary ``engine.step()``, whatever that step did (a custom
    loop over the client optimizer; DeepSpeed does not know it)."""


class Gather(str, Enum):
    """A ``deepspeed.zero.GatheredParameters`` context of the training loop's own (at ZeRO-1/2 and stage 0 the
    context does nothing: no parameter is partitioned)."""

    NONE = "none"
    READ = "read"
    """Every parameter gathered at once (``modifier_rank=None``) and read: TRL's weight sync to vLLM and its
    ``unwrap_model_for_generation``, a callback logging weight norms."""
    EDIT = "edit"
    """The Linear weight of the first block whose Linear is trainable and in the optimizer halved in place, as
    DeepSpeed documents a change of a trained parameter (deepspeedai/DeepSpeed#2424): under
    ``GatheredParameters(modifier_rank=0)`` and, where DeepSpeed keeps an fp32 master copy (ZeRO-1/2/3,
    ``BF16_Optimizer``), ``safe_set_full_fp32_param`` of the master halved.  PyTorch: the parameter halved."""


SUBMODULES = ("norm", "lin")
"""The two sub-modules of every block, in forward order."""

PARAMS_PER_SUBMODULE = ("weight", "bias")


@dataclass(frozen=True)
class Block:
    """One block ``x -> lin(norm(x))`` (a sub-module marked unused is skipped)."""

    checkpoint: Checkpoint = Checkpoint.NONE
    norm: ParamKind = ParamKind.TRAINABLE
    lin: ParamKind = ParamKind.TRAINABLE
    leaf: bool = False
    """Under ZeRO-3: the block is a z3 leaf module (one fetch, one backward hook for all its params)."""
    in_optimizer: bool = True
    """False: the block's trainable parameters are in no optimizer parameter group (they still require
    grad and get gradients; nothing updates them)."""

    def kind_of(self, submodule: str) -> ParamKind:
        if submodule not in SUBMODULES:
            raise AttributeError(f"a block has no sub-module {submodule!r}; its sub-modules are {SUBMODULES}")
        return self.norm if submodule == "norm" else self.lin

    @property
    def has_frozen(self) -> bool:
        return ParamKind.FROZEN in (self.norm, self.lin)

    @property
    def has_trainable(self) -> bool:
        return ParamKind.TRAINABLE in (self.norm, self.lin)


@dataclass(frozen=True)
class MicroStep:
    """One forward and one backward."""

    backward: BackwardKind = BackwardKind.ENGINE
    skip: tuple[int, ...] = ()
    """Blocks whose (frozen) norm this micro-step's forward skips: a data-dependent branch.  The
    module order differs from other micro-steps (which invalidates the ZeRO-3 trace) while the set
    of parameters that get gradients does not, so only a frozen norm may be skipped."""
    retain: bool = False
    """Two backwards of half the loss each, the first with ``retain_graph=True``."""
    zero_grad: bool = False
    """With ``retain``: ``engine.zero_grad()`` between the two backwards (separate losses of one retained graph, each
    stepped on its own: PyTorch keeps only the second backward's gradient).  One micro-step per train step (gas 1):
    mid-accumulation, PyTorch's ``zero_grad`` would also clear the earlier micro-steps' gradients."""


@dataclass(frozen=True)
class TrainStep:
    """``gas`` micro-steps followed by ``engine.step()``."""

    micro: tuple[MicroStep, ...] = (MicroStep(),)
    eval_before: bool = False
    """An eval-mode ``torch.no_grad()`` forward runs before this step's first micro-step."""
    reregister: bool = False
    """ZeRO-3's module hooks are removed and registered again before this step (and before its eval
    forward), as TRL's ``unwrap_model_for_generation`` does around generation."""
    idle: bool = False
    """No forward and no backward: only the ``gas`` calls of ``engine.step()`` (a step without gradient)."""
    frozen: tuple[int, ...] = ()
    """Blocks whose (trainable) Linear has ``requires_grad=False`` during this step only."""
    unused: tuple[int, ...] = ()
    """Blocks whose (trainable) Linear this step's forwards do not apply -- a module used in some steps only (a head
    used at eval, routing, a branch per phase): its parameters still require grad and get no gradient this step.
    Written to JSON only when set."""
    gather: Gather = Gather.NONE
    """A ``GatheredParameters`` context of the loop's (`Gather`): before the step's first forward (after the previous
    step's ``engine.step()``), or with ``gather_inside`` after its first micro-step's backward (before
    ``engine.step()`` at gas 1, between micro-steps else: HF's ``on_pre_optimizer_step`` callback).  Written to JSON
    only when set."""
    gather_inside: bool = False
    save_load: bool = False
    """A DeepSpeed checkpoint (not activation checkpointing) before this step (after the previous step's
    ``engine.step()``, as HF Trainer saves every ``save_steps``): ``engine.save_checkpoint(tmp)`` then
    ``engine.load_checkpoint(tmp)`` into the same engine; at ZeRO-3 first the consolidated 16-bit state dict
    (``stage3_gather_16bit_weights_on_model_save``, what HF / Accelerate save), compared with the engine's
    parameters and the oracle's (`net.checkpoint_round_trip`).  Written to JSON only when set."""
    resume: bool = False
    """HF Trainer's ``resume_from_checkpoint`` before this step: ``engine.save_checkpoint(tmp)``, the engine destroyed,
    the model built again as before training, a fresh engine (same config, a new client optimizer and scheduler)
    loads the checkpoint and trains on.  PyTorch: nothing changes.  Written to JSON only when set."""


__all__ = ["PARAMS_PER_SUBMODULE", "SUBMODULES", "BackwardKind", "Block", "Checkpoint", "Family", "Gather",
           "MicroStep", "Offload", "Optimizer", "Outputs", "ParamKind", "Precision", "Scheduler", "TrainStep"]
