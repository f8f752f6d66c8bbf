"""The network a scenario describes: its modules, parameters and autograd reach.

Names follow the real ``torch.nn.Module`` the deepspeed target builds
(``blocks.{i}.norm.weight``, ``blocks.{i}.lin.bias``, ``head.weight``), so a
model trace and a real trace name the same things.

Reach is what ``count_used_parameters_in_backward`` sees: which trainable
parameters' gradient nodes the *current* autograd graph task will execute.

* The user's backward (the outer graph task) reaches the trainable, used
  parameters of plain and non-reentrant-checkpointed blocks.
* A reentrant-checkpointed block ran its forward under ``no_grad``; its
  parameters join only the *nested* graph task that its checkpoint node starts
  during backward.  So the reach of "the backward" grows across phases.
* A reentrant block passes ``requires_grad`` only from its input (the
  parameters are not inputs of ``CheckpointFunction``): if its input does not
  require grad, nothing reaches its parameters at all.
* The fused head's weight is reached only by the backward made inside forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .scenario import PARAMS_PER_SUBMODULE, SUBMODULES, Checkpoint, ParamKind, Scenario

HEAD = "head"
HEAD_WEIGHT = "head.weight"
ROOT = "model"
"""The root module (``torch`` names it ``""``).  It has no parameters of its own, but ZeRO-3 hooks it
like any module: its pre-backward opens every backward and, while its post-backward has not fired,
it sits at the bottom of the coordinator's stack of backward modules in progress."""


def params_of_module(name: str) -> tuple[str, ...]:
    """The parameters ZeRO-3 fetches for hooked module ``name``, from the name alone.

    ``blocks.{i}.norm`` / ``blocks.{i}.lin``: its weight and bias; ``blocks.{i}`` (a z3 leaf block):
    every parameter under it (``iter_params(recurse=True)``); ``head``: its weight; the root: none.
    Specs use this to know what a module computes with from a trace alone.
    """
    if name == HEAD:
        return (HEAD_WEIGHT,)
    parts = name.split(".")
    if parts[0] != "blocks":
        return ()
    if len(parts) == 2:
        return tuple(f"{name}.{s}.{p}" for s in SUBMODULES for p in PARAMS_PER_SUBMODULE)
    return tuple(f"{name}.{p}" for p in PARAMS_PER_SUBMODULE)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor."""

    name: str
    module: str
    block: int | None
    kind: ParamKind
    numel: int
    persistent: bool
    """Below ``stage3_param_persistence_threshold``: never partitioned under ZeRO-3."""

    @property
    def trainable(self) -> bool:
        return self.kind is not ParamKind.FROZEN

    @property
    def frozen(self) -> bool:
        return self.kind is ParamKind.FROZEN


@dataclass(frozen=True)
class ModuleInfo:
    """One sub-module (``blocks.{i}.norm``, ``blocks.{i}.lin`` or ``head``)."""

    name: str
    block: int | None
    params: tuple[str, ...]
    used: bool
    """False when the scenario marks the sub-module unused: forward skips it."""


def param_numel(submodule: str, pname: str, width: int) -> int:
    if submodule == "lin" and pname == "weight":
        return width * width
    return width


class Network:
    """Derived facts about a scenario's network.  Cheap to build; cache per scenario."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self._hook_group_cache: dict[tuple[int, bool], tuple[HookGroup, ...]] = {}

    # ------------------------------------------------------------- structure
    @cached_property
    def modules(self) -> tuple[ModuleInfo, ...]:
        out = []
        for i, block in enumerate(self.scenario.blocks):
            for sub in SUBMODULES:
                name = f"blocks.{i}.{sub}"
                out.append(ModuleInfo(name, i, tuple(f"{name}.{p}" for p in PARAMS_PER_SUBMODULE),
                                      block.kind_of(sub) is not ParamKind.UNUSED))
        if self.scenario.fused_head:
            out.append(ModuleInfo(HEAD, None, (HEAD_WEIGHT,), True))
        return tuple(out)

    @cached_property
    def params(self) -> dict[str, ParamInfo]:
        sc = self.scenario
        out: dict[str, ParamInfo] = {}
        for i, block in enumerate(sc.blocks):
            for sub in SUBMODULES:
                for p in PARAMS_PER_SUBMODULE:
                    numel = param_numel(sub, p, sc.width)
                    name = f"blocks.{i}.{sub}.{p}"
                    out[name] = ParamInfo(name, f"blocks.{i}.{sub}", i, block.kind_of(sub), numel,
                                          self.is_persistent(numel))
        if sc.fused_head:
            numel = sc.width * sc.width
            out[HEAD_WEIGHT] = ParamInfo(HEAD_WEIGHT, HEAD, None, ParamKind.TRAINABLE, numel,
                                         self.is_persistent(numel))
        return out

    def is_persistent(self, numel: int) -> bool:
        """ZeRO-3 keeps a parameter whole when ``ds_numel <= stage3_param_persistence_threshold``."""
        return self.scenario.stage == 3 and numel <= self.scenario.persistence_threshold

    def module(self, name: str) -> ModuleInfo:
        return self._module_index[name]

    @cached_property
    def _module_index(self) -> dict[str, ModuleInfo]:
        return {m.name: m for m in self.modules}

    def block_modules(self, i: int) -> tuple[ModuleInfo, ...]:
        """The used sub-modules of block i, in forward order."""
        return tuple(m for m in self.modules if m.block == i and m.used)

    def leaf_blocks(self) -> tuple[int, ...]:
        """Blocks that are z3 leaf modules (ZeRO-3 only)."""
        if self.scenario.stage != 3:
            return ()
        return tuple(i for i, b in enumerate(self.scenario.blocks) if b.leaf)

    def is_leaf(self, block: int | None) -> bool:
        return block is not None and block in self.leaf_blocks()

    def hook_groups(self, i: int, skip_norm: bool = False) -> tuple[HookGroup, ...]:
        """The modules ZeRO-3 hooks in block i, in forward order (a z3 leaf block is one module).

        ``skip_norm``: this forward takes the branch that skips the block's (frozen) norm.
        """
        return self._hook_groups(i, skip_norm)

    def _hook_groups(self, i: int, skip_norm: bool) -> tuple[HookGroup, ...]:
        key = (i, skip_norm)
        cache = self._hook_group_cache
        if key not in cache:
            cache[key] = self._build_hook_groups(i, skip_norm)
        return cache[key]

    def _build_hook_groups(self, i: int, skip_norm: bool) -> tuple[HookGroup, ...]:
        input_needs_grad = self.block_input_requires_grad(i)
        needs_grad = input_needs_grad
        mods = [m for m in self.block_modules(i) if not (skip_norm and m.name.endswith(".norm"))]
        live: list[str] = []
        for m in mods:
            kind = self.params[m.params[0]].kind
            if kind is ParamKind.FROZEN and needs_grad:
                # The op saves its parameters for backward only when its output requires grad, i.e. (the
                # parameters being frozen) when its input does.  LayerNorm saves weight and bias
                # themselves; under ZeRO-3 Linear runs LinearFunctionForZeroStage3, which saves weight
                # and bias themselves too.  Non-reentrant checkpoint keeps those (not requiring grad)
                # as live references (`HookGroup.saved_live`).
                live += m.params
            needs_grad = needs_grad or kind is ParamKind.TRAINABLE
        if self.is_leaf(i):
            block = f"blocks.{i}"
            return (HookGroup(block, params_of_module(block), input_needs_grad, needs_grad, tuple(live)),)
        out = []
        needs_grad = input_needs_grad
        for m in mods:
            output_needs_grad = needs_grad or self.params[m.params[0]].kind is ParamKind.TRAINABLE
            out.append(HookGroup(m.name, m.params, needs_grad, output_needs_grad,
                                 tuple(p for p in m.params if p in live)))
            needs_grad = output_needs_grad
        return tuple(out)

    def block_input_requires_grad(self, i: int) -> bool:
        return self.scenario.input_requires_grad if i == 0 else self.output_requires_grad[i - 1]

    # ------------------------------------------------------------- autograd
    @cached_property
    def output_requires_grad(self) -> tuple[bool, ...]:
        """``requires_grad`` of each block's output, in block order."""
        needs_grad = self.scenario.input_requires_grad
        out = []
        for i, block in enumerate(self.scenario.blocks):
            if block.checkpoint is not Checkpoint.REENTRANT:
                needs_grad = needs_grad or any(self.params[p].kind is ParamKind.TRAINABLE
                                               for m in self.block_modules(i) for p in m.params)
            out.append(needs_grad)
        return tuple(out)

    @property
    def loss_requires_grad(self) -> bool:
        """The loss (or the fused head's loss, whose only tensor input is the hidden state) requires grad."""
        return bool(self.output_requires_grad[-1])

    def gradient_reaches_block(self, i: int) -> bool:
        """The user's backward runs block i's backward (its output requires grad)."""
        return self.output_requires_grad[i]

    def hooked_params(self, i: int) -> tuple[str, ...]:
        """Trainable, used parameters of block i that get a gradient in the user's backward."""
        if not self.gradient_reaches_block(i):
            return ()
        return tuple(p for m in self.block_modules(i) for p in m.params
                     if self.params[p].kind is ParamKind.TRAINABLE)

    @cached_property
    def trainable_params(self) -> tuple[str, ...]:
        """Every parameter with ``requires_grad=True`` (the optimizer's, in registration order)."""
        return tuple(n for n, p in self.params.items() if p.trainable)

    @cached_property
    def non_leaf_trainable_params(self) -> tuple[str, ...]:
        return tuple(n for n in self.trainable_params if not self.is_leaf(self.params[n].block))

    def reach_of_outer_task(self) -> frozenset[str]:
        """Non-leaf trainable params the user's outer graph task will execute."""
        return frozenset(p for i, b in enumerate(self.scenario.blocks)
                         if b.checkpoint is not Checkpoint.REENTRANT and not self.is_leaf(i)
                         for p in self.hooked_params(i))

    def reach_of_nested_task(self, i: int) -> frozenset[str]:
        """Non-leaf trainable params the nested graph task of reentrant block i executes."""
        if self.is_leaf(i):
            return frozenset()
        return frozenset(self.hooked_params(i))

    def reach_of_pre_backward(self) -> frozenset[str]:
        """The backward made inside forward by the fused head reaches only the head's weight."""
        return frozenset({HEAD_WEIGHT}) if self.scenario.fused_head else frozenset()

    def leaf_hook_params(self, i: int) -> tuple[str, ...]:
        """What z3 leaf block i's backward hook (stage3.py ``reduce_leaf_module_grads``) handles: every
        optimizer parameter under the block -- ``requires_grad`` and in a parameter group
        (``self.leaf_parameters[module]``) -- used or not (an unused one gets ``param.grad =
        zeros_like(param)``).  Empty: the block has no optimizer parameter, so DeepSpeed registers no
        hook for it and does not count it."""
        if not self.is_leaf(i) or not self.scenario.blocks[i].in_optimizer:
            return ()
        return tuple(p for sub in SUBMODULES for p in self.module(f"blocks.{i}.{sub}").params
                     if self.params[p].kind is not ParamKind.FROZEN)

    def leaf_grad_params(self, i: int) -> tuple[str, ...]:
        """The parameters of z3 leaf block i whose gradient PyTorch accumulates when the block's backward
        runs (`EventKind.LEAF_GRAD`): the used ones that require grad, in backward order (``lin`` first)."""
        if not self.is_leaf(i) or not self.gradient_reaches_block(i):
            return ()
        return tuple(p for sub in reversed(SUBMODULES) for p in self.module(f"blocks.{i}.{sub}").params
                     if self.params[p].kind is ParamKind.TRAINABLE)

    def leaf_hook_early(self, i: int) -> bool:
        """No input of z3 leaf block i requires grad: torch fires the block's full backward hook as soon as
        its output's gradient is known, before the block's backward (known issue z3-leaf-input-without-grad)."""
        return self.is_leaf(i) and not self.block_input_requires_grad(i)

    def leaf_pending(self, i: int) -> tuple[str, ...]:
        """The parameters of z3 leaf block i's hook whose gradient the running backward will still accumulate
        when the hook fires: those of `leaf_grad_params` when the hook fires early, else none."""
        if not self.leaf_hook_early(i):
            return ()
        hooked = set(self.leaf_hook_params(i))
        return tuple(p for p in self.leaf_grad_params(i) if p in hooked)

    @property
    def leaf_module_count(self) -> int:
        """ZeRO-3 adds ``len(self.leaf_parameters)`` to every expected-hook count (stage3.py): the z3 leaf
        modules that have optimizer parameters (an all-frozen leaf block has no hook and adds nothing)."""
        return sum(1 for i in self.leaf_blocks() if self.leaf_hook_params(i))


@dataclass(frozen=True)
class HookGroup:
    """One module ZeRO-3 hooks (a sub-module, or a whole z3 leaf block) in one forward."""

    module: str
    params: tuple[str, ...]
    """What its fetch gathers (a leaf block: every parameter under it)."""
    input_requires_grad: bool
    """Its post-backward hook fires only then (DeepSpeed hangs it on the module's inputs)."""
    output_requires_grad: bool
    """Its pre-backward hook fires only then (DeepSpeed hangs it on the module's outputs)."""
    saved_live: tuple[str, ...]
    """Frozen parameters its ops save for backward as themselves (not detached, not a view): a
    non-reentrant checkpoint keeps them as live references."""


__all__ = ["HEAD", "HEAD_WEIGHT", "HookGroup", "ModuleInfo", "Network", "ParamInfo", "ROOT", "param_numel",
           "params_of_module"]
