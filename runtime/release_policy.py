"""The `zerostate` release policy for parameters fetched during an activation-checkpoint recompute.

The coordinator decision it ships (ZeRO-3, DeepSpeed 0.18.5 .. 0.19.8); it is the model's
``zerostate`` coordinator design (``model/coordinator_designs.py``), checked hook by hook on real
DeepSpeed by ``generated_tests/test_runtime_release_refinement.py``:

*  A **frozen** parameter (``requires_grad=False``) -- persistent (``ds_persist``) or not -- gathered
   by a module ``M`` whose forward hooks fire inside a **non-reentrant** checkpoint recompute (a
   graph task is running, ``torch._C._current_graph_task_id() != -1``, and the innermost saved-tensor
   hooks are torch's ``_recomputation_hook``) is not partitioned by ``M``'s post-forward release **if
   ``M``'s recomputed output requires grad** -- the recompute then saved ``M``'s tensors for ``M``'s
   backward, and non-reentrant checkpoint saves a frozen tensor as a live reference
   (``x.detach() if x.requires_grad else x``): partitioning it in place would shrink the very tensor
   the metadata check and ``M``'s backward read (``CheckpointError ... [1024] vs [0]``, seed 002).  It
   is released at ``M``'s own post-backward: the last use of the saved tensor (module granularity).
*  Persistent parameters are held too: while the trace is not COMPLETE (the first step, and after
   every invalidation) DeepSpeed's ``release_sub_module`` partitions *every* parameter of the module,
   persistent ones included -- at DeepSpeed's default ``stage3_param_persistence_threshold`` (1e5)
   small frozen weights (LayerNorm / RMSNorm) are persistent, and 0.19.0-0.19.2 crash with seed
   002's CheckpointError there.  A persistent hold is only ever dropped, never released by
   the policy itself: DeepSpeed decides (its trace-driven release skips ``ds_persist``).
*  If ``M``'s recomputed output does **not** require grad, nothing of ``M`` was saved for backward:
   its frozen parameters are released by the post-forward release right away, exactly as in a plain
   forward (their last use).  A **reentrant** recompute saves nothing live (its nested backward
   gathers again in place): nothing is held there either.
*  Trainable parameters are untouched (saved detached, immune).
*  DeepSpeed 0.19.3+ also *attributes* each recompute-fetched frozen parameter to
   the backward module being processed (``ds_recompute_parameters``), which keeps it
   gathered until that owner's backward or the epilogue (PR #8148).  The policy
   undoes that attribution right after the fetch, so the parameter's lifetime is
   decided by the rule above, not by an unrelated owner.
*  Leak guards: a hold whose module never runs its post-backward (its inputs do not
   require grad, or the backward was aborted) is dropped in the optimizer's
   backward epilogue and, at the latest, at the next forward's ``reset_step``; the
   parameter is then released unless it is persistent or another module holds it.
*  Backward leftovers (releases before 0.19.3): a module whose pre-backward fetched its
   parameters but whose post-backward never fires keeps them gathered past the backward;
   0.19.3 drains those in the epilogue (PR #8148, ``release_backward_leftovers``), and the
   `zerostate` design includes that drain, so on earlier releases the policy does it too
   (found by ``zerostate watch --runtime`` on 0.19.2: an HF embedding fed token ids).

The hold is a sentinel id (`HOLD_ID`) in ``param.ds_active_sub_modules``: DeepSpeed's
own ``__release_param`` skips any parameter with an active consumer, so no DeepSpeed
code path can partition a held parameter, and dropping the hold before the owner's
release lets DeepSpeed's normal release (trace, reuse distance) decide as usual.

Everything is patched on *instances* of one engine (its coordinator, its optimizer,
forward hooks on its modules); DeepSpeed's classes and files are not changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from .patcher import Patcher

__all__ = ["HOLD_ID", "ReleasePolicyState", "install_release_policy", "uninstall_release_policy"]

HOLD_ID = -0x2E57A7E
"""Sentinel in ``param.ds_active_sub_modules``: held by the zerostate recompute policy (never a ds_id)."""

_MANGLE = "_PartitionedParameterCoordinator__"


def _requires_grad(out: Any, depth: int = 0) -> bool:
    """Whether any tensor in a (nested) module output requires grad."""
    import torch

    if isinstance(out, torch.Tensor):
        return out.requires_grad
    if depth > 4:
        return False
    if isinstance(out, (tuple, list)):
        return any(_requires_grad(o, depth + 1) for o in out)
    if isinstance(out, dict):
        return any(_requires_grad(o, depth + 1) for o in out.values())
    return False


_RECOMPUTE_PACK = "_recomputation_hook.__init__.<locals>.pack_hook"


def in_nonreentrant_recompute() -> bool:
    """Whether torch's non-reentrant checkpoint is recomputing right now: a graph task runs and the
    innermost saved-tensor hooks are ``torch.utils.checkpoint._recomputation_hook``'s (a reentrant
    recompute runs under no saved-tensor hooks of its own)."""
    import torch

    if torch._C._current_graph_task_id() == -1:
        return False
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if not top:
        return False
    pack = getattr(top[0], "__wrapped__", top[0])
    return getattr(pack, "__qualname__", "") == _RECOMPUTE_PACK and \
        getattr(pack, "__module__", "") == "torch.utils.checkpoint"


@dataclass
class ReleasePolicyState:
    """Per-engine state and the record of every original that `install_release_policy` replaced."""

    coordinator: Any
    optimizer: Any
    frozen_of: dict[int, tuple] = field(default_factory=dict)
    """id(module) -> frozen params (persistent ones too) the module's fetch gathers."""
    out_requires_grad: dict[int, bool] = field(default_factory=dict)
    """id(module) -> whether its last recompute output required grad (set by our forward hook)."""
    holds: dict[int, tuple[Any, list]] = field(default_factory=dict)
    """id(module) -> (module, params held for that module's backward)."""
    patched: Patcher = field(default_factory=Patcher)
    """Every attribute the policy replaced, undone exactly by `uninstall_release_policy`."""
    hook_handles: list = field(default_factory=list)
    leftovers: dict[int, Any] | None = None
    """id(module) -> module whose backward fetch has not been followed by its post-backward release yet;
    None on releases whose coordinator drains these itself (0.19.3+, ``release_backward_leftovers``)."""
    stats: dict[str, int] = field(default_factory=lambda: {"held": 0, "released_at_backward": 0,
                                                           "released_at_drain": 0, "attribution_undone": 0,
                                                           "released_leftover": 0})

    # ------------------------------------------------------------- the rule
    def drop_holds(self, module_id: int) -> None:
        entry = self.holds.pop(module_id, None)
        if entry is None:
            return
        for p in entry[1]:
            p.ds_active_sub_modules.discard(HOLD_ID)
        self.stats["released_at_backward"] += len(entry[1])

    def release_backward_leftovers(self) -> None:
        """The epilogue drain DeepSpeed 0.19.3 added (PR #8148, ``release_backward_leftovers``), for releases
        without it: a module whose pre-backward fetched its parameters but whose post-backward never fired
        (its input does not require grad -- an embedding fed token ids whose output HF makes require grad
        for gradient checkpointing) keeps them gathered and held past the backward (released-after-backward,
        the model's ds-0.19.2 / pr-8130 leak).  Drop the module as a holder and release what is neither
        persistent nor external, as the missing post-backward would have; the `zerostate` design has it."""
        if not self.leftovers:
            return
        from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
        from deepspeed.utils import z3_leaf_module

        release = getattr(self.coordinator, _MANGLE + "release_param")
        modules = list(self.leftovers.values())
        self.leftovers.clear()
        for module in reversed(modules):  # DeepSpeed pops its map last-in first-out
            for p in set(iter_params(module, recurse=z3_leaf_module(module))):
                p.ds_active_sub_modules.discard(module.ds_id)
                if not getattr(p, "ds_persist", False) and not getattr(p, "is_external_param", False):
                    before = p.ds_status
                    release(p)
                    self.stats["released_leftover"] += p.ds_status != before

    def drain(self) -> None:
        """Drop every hold and release what no one else keeps gathered."""
        if not self.holds:
            return
        release = getattr(self.coordinator, _MANGLE + "release_param")
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        entries = list(self.holds.values())
        self.holds.clear()
        for _, params in entries:
            for p in params:
                p.ds_active_sub_modules.discard(HOLD_ID)
                if getattr(p, "ds_persist", False):
                    continue  # DeepSpeed keeps persistent params gathered; the hold only kept them whole
                if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_active_sub_modules:
                    release(p)
                    self.stats["released_at_drain"] += 1


def _collect_frozen(module: Any, out: dict[int, tuple], leaf_fn: Callable[[Any], bool]) -> None:
    """Frozen ZeRO-3 params (persistent ones included: DeepSpeed partitions those too while the trace is
    not COMPLETE) of every module DeepSpeed puts fetch/release hooks on."""
    is_leaf = leaf_fn(module)
    params = tuple(p for _, p in module.named_parameters(recurse=is_leaf)
                   if hasattr(p, "ds_id") and not p.requires_grad)
    if params:
        out[id(module)] = params
    if not is_leaf:
        for child in module.children():
            _collect_frozen(child, out, leaf_fn)


def check_release_policy_supported(engine: Any) -> str | None:
    """None when the policy can be installed on ``engine``, else the reason it cannot."""
    opt = getattr(engine, "optimizer", None)
    offload = getattr(opt, "parameter_offload", None)
    if offload is None or not hasattr(offload, "get_param_coordinator"):
        return "not a ZeRO-3 engine (no parameter_offload coordinator)"
    coord = offload.get_param_coordinator()
    from .leaf_reuse_walk import ATTRIBUTES  # installed with the policy (z3-leaf-kept-gathered)

    for name in ("fetch_sub_module", "release_sub_module", "reset_step", _MANGLE + "release_param", *ATTRIBUTES):
        if not hasattr(coord, name):
            return f"the parameter coordinator has no {name.replace(_MANGLE, '__')}"
    if not hasattr(opt, "backward_epilogue"):
        return "the ZeRO-3 optimizer has no backward_epilogue"
    return None


def install_release_policy(engine: Any) -> ReleasePolicyState:
    """Patch one ZeRO-3 engine's coordinator with the zerostate recompute release policy."""
    import torch
    from deepspeed.utils import z3_leaf_module

    why = check_release_policy_supported(engine)
    if why:
        raise RuntimeError(f"zerostate release policy: {why}")
    opt = engine.optimizer
    coord = opt.parameter_offload.get_param_coordinator()
    state = ReleasePolicyState(coordinator=coord, optimizer=opt)
    _collect_frozen(engine.module, state.frozen_of, z3_leaf_module)
    task_id = torch._C._current_graph_task_id
    frozen_of = state.frozen_of
    out_rg = state.out_requires_grad
    holds = state.holds
    active_name = _MANGLE + "active_backward_submodules"  # 0.19.3+: PR #8148's owner map

    orig_fetch = coord.fetch_sub_module
    orig_release = coord.release_sub_module
    orig_reset = coord.reset_step
    orig_epilogue = opt.backward_epilogue

    if not hasattr(coord, active_name):  # before 0.19.3: no epilogue drain of its own
        state.leftovers = {}
    leftovers = state.leftovers

    def fetch_sub_module(current_submodule, forward):
        if not forward and leftovers is not None:
            leftovers[id(current_submodule)] = current_submodule
        frozen = frozen_of.get(id(current_submodule)) if forward else None
        if not frozen or task_id() == -1:
            return orig_fetch(current_submodule, forward)
        # Recompute fetch of a module with frozen params: note PR #8148's attribution target.
        active = getattr(coord, active_name, None)
        try:
            owner = next(reversed(active.values())) if active else None
        except RuntimeError:  # z3 leaf hooks on autograd worker threads changed it: keep DeepSpeed's choice
            owner = None
        if owner is None:
            return orig_fetch(current_submodule, forward)
        oid = owner.ds_id
        before = [(p in owner.ds_recompute_parameters, oid in p.ds_active_sub_modules) for p in frozen]
        try:
            return orig_fetch(current_submodule, forward)
        finally:
            for p, (was_attr, had_id) in zip(frozen, before, strict=True):
                if not was_attr and p in owner.ds_recompute_parameters:
                    owner.ds_recompute_parameters.discard(p)
                    state.stats["attribution_undone"] += 1
                if not had_id and oid != current_submodule.ds_id:
                    p.ds_active_sub_modules.discard(oid)

    def release_sub_module(submodule, forward=False):
        mid = id(submodule)
        if forward:
            frozen = frozen_of.get(mid)
            if frozen and task_id() != -1 and out_rg.pop(mid, True):
                from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

                entry = holds.get(mid)
                if entry is None:
                    entry = holds[mid] = (submodule, [])
                for p in frozen:
                    if p.ds_status == ZeroParamStatus.AVAILABLE and HOLD_ID not in p.ds_active_sub_modules:
                        p.ds_active_sub_modules.add(HOLD_ID)
                        entry[1].append(p)
                        state.stats["held"] += 1
        else:
            if leftovers is not None:
                leftovers.pop(mid, None)
            if mid in holds:
                state.drop_holds(mid)
        return orig_release(submodule, forward)

    def reset_step(*args, **kwargs):
        state.drain()
        return orig_reset(*args, **kwargs)

    def backward_epilogue(*args, **kwargs):
        try:
            return orig_epilogue(*args, **kwargs)
        finally:
            state.drain()
            state.release_backward_leftovers()

    def record_output(module, inputs, output):
        if task_id() != -1:
            # Held only when a non-reentrant recompute saved the module's tensors (its output requires grad).
            out_rg[id(module)] = in_nonreentrant_recompute() and _requires_grad(output)

    # Everything validated above; from here on, changes (all recorded for uninstall).
    state.patched.set(coord, "fetch_sub_module", fetch_sub_module)
    state.patched.set(coord, "release_sub_module", release_sub_module)
    state.patched.set(coord, "reset_step", reset_step)
    state.patched.set(opt, "backward_epilogue", backward_epilogue)
    wanted = set(frozen_of)
    for m in engine.module.modules():
        if id(m) in wanted:
            state.hook_handles.append(m.register_forward_hook(record_output, prepend=True))
    return state


def uninstall_release_policy(state: ReleasePolicyState) -> None:
    """Drop every hold and restore every patched attribute and hook exactly."""
    state.drain()
    for h in state.hook_handles:
        h.remove()
    state.hook_handles.clear()
    state.patched.undo()
