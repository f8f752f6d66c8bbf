"""Hook-count designs: how each DeepSpeed era decides when the backward epilogue runs.

A design is a *value*: a `HookDesign` record holding one small function per
driver event it reacts to.  Each is read from the source of the first release
that has it:

``ds-0.18.4``
    ``_remaining_grad_acc_hooks`` counter in every gradient hook, re-armed by one
    ``count_used_parameters_in_backward`` call whenever it reaches 0; the
    epilogue runs when it hits 0 again.  With reentrant checkpointing the first
    phase exhausts the counter, so a PyTorch-style backward runs the epilogue
    after phase 1 and leaves phase 2's gradients in the bucket (seed 000 part 1,
    fixed by PR #7780).
``ds-0.18.5``
    PR #7780: ``BackwardHookStateManager``; the epilogue runs from a callback
    queued on the autograd engine; ``_pre_step`` clears stale buckets.  But
    ``count_used_parameters_in_backward`` runs in *every* hook (seed 000 part 2,
    issues #7882 / #7885).  0.18.6 is the same.
``ds-0.18.7``
    PR #7886: ``should_refresh_expected_hook_count`` counts once per phase;
    ``enter_backward`` resets counters polluted by backward calls made before the
    user's backward.  Current through 0.19.8.
``zerostate``
    What ``zerostate.runtime`` ships.  The epilogue is driven only by the queued
    callback (PyTorch-style) or by ``engine.backward`` itself, so the expected
    count is never needed: hooks do O(1) work, ``count_used_parameters_in_backward``
    is evaluated zero times per backward, and no phase boundary can trigger a
    premature epilogue.  A hook outside any user backward only buckets its gradient.
    A z3 leaf module's hook that fires before its parameters' gradients have
    accumulated (no input of the module requires grad) defers the reduction until
    they have (known issue ``z3-leaf-input-without-grad``, which every DeepSpeed
    design above keeps: it reduces at the hook).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import hook_actions
from .events import Event, EventKind
from .hook_actions import Result
from .hook_state import HookState

if TYPE_CHECKING:
    from .machine import Ctx

Reaction = Callable[[HookState, "Ctx"], Result]
GradHook = Callable[[HookState, "Ctx", tuple[str, ...]], Result]
LeafHook = Callable[[HookState, "Ctx", str], Result]
"""(state, ctx, leaf module) for LEAF_HOOK; (state, ctx, parameter) for LEAF_GRAD (`LeafGrad`)."""
LeafGrad = LeafHook


@dataclass(frozen=True)
class HookDesign:
    name: str
    release: str
    """The first DeepSpeed release with this logic (or ``zerostate``)."""
    summary: str
    provenance: tuple[str, ...]
    on_forward_start: Reaction
    on_prologue: Reaction
    on_grad_hook: GradHook
    """Reaction to a gradient hook (one param) or a leaf-module hook (all its params)."""
    on_callback: Reaction
    on_engine_backward_return: Reaction
    on_step: Reaction
    on_leaf_hook: LeafHook | None = None
    """Reaction to a z3 leaf module's hook; None: `on_grad_hook` over all its parameters, at once."""
    on_leaf_grad: LeafGrad | None = None
    """Reaction to a leaf parameter's gradient accumulating; None: none (DeepSpeed does not hook it)."""

    def react(self, hs: HookState, ev: Event, ctx: Ctx) -> Result:
        """The one transition function of this half: ``(state, event) -> (state, effects)``."""
        k = ev.kind
        if k is EventKind.FORWARD_START:
            return self.on_forward_start(hs, ctx)
        if k is EventKind.OUTPUT_HOOK:
            return self.on_prologue(hs, ctx)
        if k is EventKind.GRAD_HOOK:
            assert ev.param is not None, "a GRAD_HOOK names its parameter"
            return self.on_grad_hook(hs, ctx, (ev.param,))
        if k is EventKind.LEAF_HOOK:
            if self.on_leaf_hook is not None:
                return self.on_leaf_hook(hs, ctx, str(ev.module))
            return self.on_grad_hook(hs, ctx, ctx.leaf_params(ev.module))
        if k is EventKind.LEAF_GRAD and self.on_leaf_grad is not None:
            return self.on_leaf_grad(hs, ctx, str(ev.param))
        if k is EventKind.CALLBACK_RUN:
            return self.on_callback(hs, ctx)
        if k is EventKind.USER_BACKWARD_END:
            return self.on_engine_backward_return(hs, ctx)
        if k is EventKind.STEP:
            return self.on_step(hs, ctx)
        return hs, ()


# ------------------------------------------------------------------ ds-0.18.4
def _prologue_0184(hs: HookState, ctx: Ctx) -> Result:
    return hook_actions.enter_backward_plain(hs, ctx)


def _grad_hook_0184(hs: HookState, ctx: Ctx, params: tuple[str, ...]) -> Result:
    """stage3.py / stage_1_and_2.py 0.18.4: ``if remaining == 0: remaining = count(...)``."""
    effects: tuple[Event, ...] = ()
    if hs.remaining == 0:
        value, effects = hook_actions.count_used(ctx)
        hs = hs.with_(remaining=value)
    effects += hook_actions.process_gradients(params)
    hs = hs.with_(remaining=hs.remaining - 1)
    if hs.remaining == 0:
        hs, more = hook_actions.run_post_hooks(hs, ctx)
        effects += more
    return hs, effects


# ------------------------------------------------------------------ ds-0.18.5
def _prologue_0185(hs: HookState, ctx: Ctx) -> Result:
    """engine._backward_prologue 0.18.5+: ``enter_backward()``, ``queue_post_backward_callback()``."""
    hs, eff = hook_actions.enter_backward_mark_seen(hs, ctx)
    hs, more, _ = hook_actions.queue_post_backward_callback(hs, ctx)
    return hs, eff + more


def _grad_hook_0185(hs: HookState, ctx: Ctx, params: tuple[str, ...]) -> Result:
    """0.18.5/0.18.6: reenter, process, ``count_used_parameters_in_backward`` in every hook."""
    hs, eff = hook_actions.reenter_backward_if_needed(hs, ctx)
    eff += hook_actions.process_gradients(params)
    value, counted = hook_actions.count_used(ctx)
    hs, more = hook_actions.update_hook_state_and_maybe_run_epilogue(hs, value, ctx)
    return hs, eff + counted + more


def _callback(hs: HookState, ctx: Ctx) -> Result:
    """The queued post-backward callback: ``run_grad_acc_post_hooks``."""
    return hook_actions.run_post_hooks(hs, ctx)


def _clear_stale_buckets(hs: HookState, ctx: Ctx) -> Result:
    """stage3 ``_pre_step`` 0.18.5+ (PR #7780): drop params left in ipg buckets."""
    if ctx.stage == 3 and ctx.bucket:
        return hs, (Event(EventKind.BUCKET_CLEAR, value=len(ctx.bucket)),)
    return hs, ()


# ------------------------------------------------------------------ ds-0.18.7
def _prologue_0187(hs: HookState, ctx: Ctx) -> Result:
    hs, eff = hook_actions.enter_backward_resetting(hs, ctx)
    hs, more, _ = hook_actions.queue_post_backward_callback(hs, ctx)
    return hs, eff + more


def _grad_hook_0187(hs: HookState, ctx: Ctx, params: tuple[str, ...]) -> Result:
    """0.18.7+: evaluate ``should_refresh`` *before* reentering; count only when it says so."""
    refresh = hook_actions.should_refresh_expected_hook_count(hs)
    hs, eff = hook_actions.reenter_backward_if_needed(hs, ctx)
    eff += hook_actions.process_gradients(params)
    if refresh:
        value, counted = hook_actions.count_used(ctx)
        eff += counted
    else:
        value = hs.max_expected
    hs, more = hook_actions.update_hook_state_and_maybe_run_epilogue(hs, value, ctx)
    return hs, eff + more


# ------------------------------------------------------------------ zerostate
def _grad_hook_zerostate(hs: HookState, ctx: Ctx, params: tuple[str, ...]) -> Result:
    """Bucket the gradient; the epilogue belongs to the callback or to engine.backward.

    Outside a user backward (a backward made inside forward) nothing else
    happens.  Inside one, the callback queued by the prologue is already in
    place; ``fired`` is kept for observability only.
    """
    eff = hook_actions.process_gradients(params)
    if hs.depth == 0:
        return hs, eff
    hs, more, _ = hook_actions.queue_post_backward_callback(hs, ctx)
    return hs.with_(fired=hs.fired + 1), eff + more


def _leaf_hook_zerostate(hs: HookState, ctx: Ctx, module: str) -> Result:
    """A z3 leaf module's hook: reduce its parameters now, or -- when it fired before gradients the running
    backward will still accumulate (no input of the module requires grad) -- once they have.

    Known issue z3-leaf-input-without-grad (known/issues.py): DeepSpeed reduces at once and
    zero-fills the still-partitioned ``.grad``; the real gradients then fail to accumulate.  The fix of
    docs/upstream/z3-leaf-input-without-grad/fix.patch; the leaf still counts once, in the same backward.
    """
    pending = ctx.leaf_pending(module)
    if pending:
        return hook_actions.defer_leaf_reduction(hs, module, pending)
    return _grad_hook_zerostate(hs, ctx, ctx.leaf_params(module))


def _leaf_grad_zerostate(hs: HookState, ctx: Ctx, param: str) -> Result:
    """A leaf parameter's gradient accumulated: the deferred reduction runs after the last one awaited."""
    hs, ready = hook_actions.leaf_grad_accumulated(hs, param)
    if ready is None:
        return hs, ()
    return _grad_hook_zerostate(hs, ctx, ctx.leaf_params(ready))


DS_0_18_4 = HookDesign(
    name="ds-0.18.4", release="0.18.4",
    summary="remaining-hooks counter re-armed by one count; epilogue when it reaches 0",
    provenance=("deepspeedai/DeepSpeed#7780 (the bug it fixed)",),
    on_forward_start=hook_actions.keep, on_prologue=_prologue_0184, on_grad_hook=_grad_hook_0184,
    on_callback=hook_actions.keep, on_engine_backward_return=hook_actions.epilogue_if_engine_backward,
    on_step=hook_actions.keep,
)

DS_0_18_5 = HookDesign(
    name="ds-0.18.5", release="0.18.5",
    summary="queued post-backward callback; count_used_parameters_in_backward in every hook",
    provenance=("deepspeedai/DeepSpeed#7780", "deepspeedai/DeepSpeed#7882", "deepspeedai/DeepSpeed#7885"),
    on_forward_start=hook_actions.reset_for_new_step, on_prologue=_prologue_0185, on_grad_hook=_grad_hook_0185,
    on_callback=_callback, on_engine_backward_return=hook_actions.epilogue_if_engine_backward,
    on_step=_clear_stale_buckets,
)

DS_0_18_7 = HookDesign(
    name="ds-0.18.7", release="0.18.7",
    summary="refresh predicate: count once per phase; reset on first real enter_backward",
    provenance=("deepspeedai/DeepSpeed#7886",),
    on_forward_start=hook_actions.reset_for_new_step, on_prologue=_prologue_0187, on_grad_hook=_grad_hook_0187,
    on_callback=_callback, on_engine_backward_return=hook_actions.epilogue_if_engine_backward,
    on_step=_clear_stale_buckets,
)

ZEROSTATE = HookDesign(
    name="zerostate", release="zerostate",
    summary="epilogue only from the queued callback or engine.backward; O(1) hooks, no counting",
    provenance=("deepspeedai/DeepSpeed#7780", "deepspeedai/DeepSpeed#7886"),
    on_forward_start=hook_actions.reset_for_new_step, on_prologue=_prologue_0187,
    on_grad_hook=_grad_hook_zerostate, on_callback=_callback,
    on_engine_backward_return=hook_actions.epilogue_if_engine_backward, on_step=_clear_stale_buckets,
    on_leaf_hook=_leaf_hook_zerostate, on_leaf_grad=_leaf_grad_zerostate,
)

HOOK_DESIGNS: dict[str, HookDesign] = {d.name: d for d in (DS_0_18_4, DS_0_18_5, DS_0_18_7, ZEROSTATE)}

__all__ = ["DS_0_18_4", "DS_0_18_5", "DS_0_18_7", "HOOK_DESIGNS", "HookDesign", "ZEROSTATE"]
