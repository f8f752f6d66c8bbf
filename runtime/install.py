"""Install the zerostate runtime into a live DeepSpeed engine, and take it out again.

``install(engine)`` changes only that engine's objects:

1. the hook state: ``engine.optimizer._backward_hook_state`` becomes a
   `ZerostateBackwardHookState` carrying the old manager's post hooks and counters;
2. on releases whose gradient hooks call ``count_used_parameters_in_backward`` in
   every hook (0.18.5, 0.18.6), each hook function is replaced *in its hook
   dictionary* (``param._post_accumulate_grad_hooks`` / ``module._backward_hooks``,
   same key, same order) by the 0.18.7-shaped closure that asks the hook state
   whether to count -- and the zerostate hook state never asks; on every release,
   each ZeRO-3 z3 leaf module's hook is wrapped (same key, same order) so that its
   reduction waits for the gradients the backward will still accumulate
   (`leaf_deferral`: DeepSpeed's known issue ``z3-leaf-input-without-grad``);
3. under ZeRO-3 (0.19.0 on), the recompute release policy (`release_policy`) and, with it, the
   coordinator's reuse walk that takes each walked module's own leaf-ness (`leaf_reuse_walk`: DeepSpeed's
   known issue ``z3-leaf-kept-gathered``).

Every change goes through one `Patcher` (``runtime/patcher.py``) and is recorded there;
``uninstall(engine)`` undoes the record, last change first, and so puts back the identical
objects (the original manager, the original hook functions under their original keys, the
instance attributes as they were, no hook of ours left registered).  Installing twice is a no-op.  An unsupported
DeepSpeed release, a missing PyTorch internal, an engine the design does not cover
(`engine_support`: no ZeRO optimizer, ``BF16_Optimizer``, NVMe offload, gradient hooks of
an unknown shape) or an engine in the middle of a backward is refused with a clear error
*before anything is changed*; under `patch_deepspeed` such an engine gets one warning and
stays stock -- ``deepspeed.initialize`` never raises because of the runtime.

Supported engines: ZeRO stage 1, 2 and 3 (``DeepSpeedZeroOptimizer``,
``DeepSpeedZeroOptimizer_Stage3``) in fp32, bf16 or fp16, with or without CPU offload of
the optimizer state (``offload_optimizer``) and, under ZeRO-3, of the parameters
(``offload_param``): their gradient hooks are the closures of the table below whatever
the precision or offload device.

Parameters frozen or unfrozen after install: the release policy's frozen set is
re-collected (the policy re-installed through its public API) at the first root forward
after any ``requires_grad`` changed; a parameter made trainable after
``deepspeed.initialize`` gets a warning -- DeepSpeed registered no gradient hook for it.

Each install logs one INFO line on the ``zerostate.runtime`` logger (release, stage, what
was changed); each refusal under `patch_deepspeed` one WARNING.

This file holds the installation itself.  Its parts are files of their own: the supported
releases (`compat_table.COMPAT`, the runtime's rows of the one era table), the engines covered
(`engine_support`), the hook closures and their replacement (`hook_closures`), the errors
(`errors`), and `patch_deepspeed` (`initialize_patch`).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

from .compat_table import CompatRow, compat_row, release_policy_range
from .engine_support import engine_support
from .errors import UnsupportedEngineError, ZerostateInstallError
from .hook_closures import ClosureSwap, plan_closure_swaps
from .hook_state_manager import MissingTorchInternalsError, TorchAutograd, ZerostateBackwardHookState
from .leaf_deferral import Wrapper
from .leaf_reuse_walk import PARAMS_TO_RELEASE, fixed_params_to_release
from .patcher import Patcher
from .release_policy import (ReleasePolicyState, check_release_policy_supported, install_release_policy,
                             uninstall_release_policy)

__all__ = ["Installation", "install", "installation", "is_installed", "uninstall"]

log = logging.getLogger("zerostate.runtime")


@dataclass
class Installation:
    """What install() changed on one engine (everything uninstall() needs to put back)."""

    version: str
    row: CompatRow
    optimizer: Any
    original_manager: Any
    manager: ZerostateBackwardHookState
    swaps: list[ClosureSwap] = field(default_factory=list)
    patcher: Patcher = field(default_factory=Patcher)
    """Every change this installation made, in order; `uninstall` undoes it (`Patcher.undo`)."""
    release: ReleasePolicyState | None = None
    engine_ref: Any = None
    """weakref to the engine (the frozen-set refresh re-installs the release policy on it)."""
    requires_grad: tuple[bool, ...] = ()
    """``requires_grad`` of every module parameter when last checked (install, then each root forward)."""
    trainable_at_install: frozenset[int] = frozenset()
    refresh_handle: Any = None
    refreshes: int = 0
    """How many times a ``requires_grad`` change re-collected the release policy's frozen set."""

    @property
    def release_policy(self) -> bool:
        return self.release is not None

    def describe(self) -> str:
        """What this installation changed, in one line (the install log line)."""
        parts = [f"hook state {type(self.manager).__name__} on {type(self.optimizer).__name__}"]
        counted = [s for s in self.swaps
                   if not s.leaf_deferral or cast(Wrapper, s.replacement).__wrapped__ is not s.original]
        if counted:
            parts.append(f"{len(counted)} gradient-hook closures replaced (count in every hook, #7882)")
        else:
            parts.append("DeepSpeed's gradient-hook closures kept")
        leaves = sum(1 for s in self.swaps if s.leaf_deferral)
        if leaves:
            parts.append(f"{leaves} z3 leaf-module hooks deferred while gradients are to accumulate "
                         "(z3-leaf-input-without-grad)")
        if self.release is not None:
            parts.append(f"ZeRO-3 recompute release policy on {len(self.release.frozen_of)} modules with frozen "
                         f"parameters ({self.row.release_policy}); reuse walk by each module's leaf-ness "
                         "(z3-leaf-kept-gathered)")
        return "; ".join(parts)


_INSTALLED: weakref.WeakKeyDictionary[Any, Installation] = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def installation(engine: Any) -> Installation | None:
    return _INSTALLED.get(engine)


def is_installed(engine: Any) -> bool:
    return engine in _INSTALLED


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def install(engine: Any, *, release_policy: bool | None = None) -> Installation:
    """Install the zerostate hook state (and, under ZeRO-3, the release policy) into ``engine``.

    ``release_policy``: None (default) installs it when the engine is ZeRO-3 and the
    release supports it; True requires it (error otherwise); False skips it.
    Returns the `Installation` record; a second call returns the same record.
    """
    with _LOCK:
        done = _INSTALLED.get(engine)
        if done is not None:
            return done
        # ---- every check first; nothing is changed until all pass
        version = _deepspeed_version()
        row = compat_row(version)
        try:
            autograd = TorchAutograd()
        except MissingTorchInternalsError as e:
            raise ZerostateInstallError(str(e)) from None
        why_not = engine_support(engine)
        if why_not:
            raise UnsupportedEngineError(f"{why_not}. Nothing was changed.")
        opt = engine.optimizer
        old = opt._backward_hook_state
        if getattr(old, "backward_active_depth", 0):
            raise ZerostateInstallError("install() called during a backward (backward_active_depth > 0); "
                                        "install between train steps. Nothing was changed.")
        swaps = plan_closure_swaps(opt, row)
        want_release = release_policy
        why = check_release_policy_supported(engine) if want_release is not False else "not requested"
        if want_release is None:
            want_release = why is None and row.release_policy is not None
        elif want_release:
            if row.release_policy is None:
                raise ZerostateInstallError(
                    f"the zerostate release policy supports DeepSpeed {release_policy_range()}; "
                    f"installed {version}. Nothing was changed.")
            if why:
                raise ZerostateInstallError(f"release policy: {why}. Nothing was changed.")
        module = getattr(engine, "module", None)
        params = list(module.parameters()) if module is not None else []
        # ---- apply (all or nothing: any failure puts back what was done so far)
        manager = ZerostateBackwardHookState.from_manager(old, autograd)
        inst = Installation(version, row, opt, old, manager, engine_ref=weakref.ref(engine),
                            requires_grad=tuple(p.requires_grad for p in params),
                            trainable_at_install=frozenset(id(p) for p in params if p.requires_grad))
        patch = inst.patcher
        try:
            patch.set(opt, "_backward_hook_state", manager, guard=True)
            patch.on_undo(lambda: _hand_state_back(inst))
            for s in swaps:
                patch.set_item(s.hooks, s.key, s.replacement, guard=True)
                inst.swaps.append(s)
            if want_release:
                inst.release = install_release_policy(engine)
                patch.on_undo(lambda: _drop_release_policy(inst))
                coord = opt.parameter_offload.get_param_coordinator()
                patch.set(coord, PARAMS_TO_RELEASE, fixed_params_to_release(coord), guard=True)
            if module is not None:
                inst.refresh_handle = module.register_forward_pre_hook(
                    functools.partial(_refresh_frozen_set, weakref.ref(inst)), prepend=True)
                patch.on_undo(inst.refresh_handle.remove)
        except BaseException:
            patch.undo()
            raise
        _INSTALLED[engine] = inst
        log.info("zerostate.runtime installed into DeepSpeed %s ZeRO-%s engine: %s", version,
                 _stage(engine), inst.describe())
        return inst


def _stage(engine: Any) -> Any:
    fn = getattr(engine, "zero_optimization_stage", None)
    return fn() if callable(fn) else "?"


def _refresh_frozen_set(inst_ref: weakref.ref[Installation], module: Any, args: Any) -> None:
    """Root forward pre-hook: when a parameter's ``requires_grad`` changed since the last check,
    re-collect the release policy's frozen set (uninstall + install through its public API; at a
    root forward no hold is in flight that the next ``reset_step`` would not drop anyway)."""
    inst = inst_ref()
    if inst is None:
        return
    params = list(module.parameters())
    now = tuple(p.requires_grad for p in params)
    if now == inst.requires_grad:
        return
    import torch

    if torch._C._current_graph_task_id() != -1:
        return  # inside a backward (a recompute): wait for the next root forward
    with _LOCK:
        inst.requires_grad = now
        late = [p for p in params if p.requires_grad and id(p) not in inst.trainable_at_install]
        if late:
            log.warning("zerostate.runtime: %d parameter(s) became trainable after install; DeepSpeed's ZeRO "
                        "optimizer registers gradient hooks and optimizer partitions in deepspeed.initialize only, "
                        "so DeepSpeed may not train them", len(late))
            inst.trainable_at_install = inst.trainable_at_install | {id(p) for p in late}
        engine = inst.engine_ref() if inst.engine_ref is not None else None
        if inst.release is not None and engine is not None:
            uninstall_release_policy(inst.release)
            inst.release = None
            inst.release = install_release_policy(engine)
            inst.refreshes += 1
            log.info("zerostate.runtime: requires_grad changed; release policy frozen set re-collected "
                     "(%d modules with frozen parameters)", len(inst.release.frozen_of))


def _hand_state_back(inst: Installation) -> None:
    """Before the original manager is put back: give it the counters the zerostate hook state kept."""
    if inst.optimizer._backward_hook_state is inst.manager:
        inst.manager.copy_state_to(inst.original_manager)


def _drop_release_policy(inst: Installation) -> None:
    """Uninstall the release policy installed now (a ``requires_grad`` refresh may have replaced it)."""
    if inst.release is not None:
        uninstall_release_policy(inst.release)
        inst.release = None


def uninstall(engine: Any) -> bool:
    """Restore everything install() changed on ``engine``.  Returns False if it was not installed."""
    with _LOCK:
        inst = _INSTALLED.pop(engine, None)
        if inst is None:
            return False
        inst.patcher.undo()
        return True
