"""The named actions of the gradient-hook / epilogue protocol, as pure functions.

Each action takes a `HookState` (and a `Ctx` when it needs the environment)
and returns the new state plus the effect events it caused, mirroring one
DeepSpeed method.  Designs (``hook_designs.py``) are assembled from these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .events import Event, EventKind
from .hook_state import HookState

if TYPE_CHECKING:
    from .machine import Ctx

Effects = tuple[Event, ...]
Result = tuple[HookState, Effects]


# --------------------------------------------------------------- enter / exit
def enter_backward_plain(hs: HookState, ctx: Ctx) -> Result:
    """0.18.4 ``ZeROOptimizer.enter_backward``: depth + 1."""
    hs = hs.with_(depth=hs.depth + 1)
    return hs, (Event(EventKind.ENTER_BACKWARD, value=hs.depth),)


def enter_backward_mark_seen(hs: HookState, ctx: Ctx) -> Result:
    """0.18.5 ``BackwardHookStateManager.enter_backward``: depth + 1, remember a backward was seen."""
    hs = hs.with_(depth=hs.depth + 1, seen=True)
    return hs, (Event(EventKind.ENTER_BACKWARD, value=hs.depth),)


def enter_backward_resetting(hs: HookState, ctx: Ctx) -> Result:
    """0.18.7 (PR #7886 item 3): on the *first* real entry of a step, drop counters polluted by
    backward calls made before the user's backward (TiledFusedLogitsLoss); then as 0.18.5."""
    if hs.depth == 0 and not hs.seen:
        hs = hs.with_(fired=0, max_expected=0, remaining=0, cb_queued=False, cb_task=None,
                      counted_task=None)
    return enter_backward_mark_seen(hs, ctx)


def exit_backward(hs: HookState, ctx: Ctx) -> Result:
    """``exit_backward``: depth - 1, never below 0."""
    if hs.depth > 0:
        hs = hs.with_(depth=hs.depth - 1)
    return hs, (Event(EventKind.EXIT_BACKWARD, value=hs.depth),)


def reset_for_new_step(hs: HookState, ctx: Ctx) -> Result:
    """0.18.5+ ``clear_backward_seen_flag`` at ``engine.forward``: per-step counters back to zero."""
    return hs.with_(seen=False, fired=0, max_expected=0, epilogue_ran=False, cb_queued=False,
                    cb_task=None, counted_task=None), ()


def keep(hs: HookState, ctx: Ctx) -> Result:
    """No reaction (the release has no hook for this event)."""
    return hs, ()


# -------------------------------------------------------------- the epilogue
def backward_epilogue(hs: HookState, ctx: Ctx) -> Result:
    """``engine._backward_epilogue``: reduce and flush the buckets, then ``exit_backward``."""
    effects = (Event(EventKind.BUCKET_FLUSH, value=len(ctx.bucket)), Event(EventKind.EPILOGUE, task=ctx.task))
    hs, ex = exit_backward(hs.with_(epilogue_ran=True), ctx)
    return hs, effects + ex


def run_post_hooks(hs: HookState, ctx: Ctx) -> Result:
    """``run_grad_acc_post_hooks`` -> ``engine._backward_post_hook``.

    Skipped while no user backward is active (depth 0: a backward made inside
    forward).  Under ``engine.backward`` the post hook does nothing: the engine
    runs the epilogue itself when ``loss.backward()`` returns.  Otherwise (a
    PyTorch-style backward) it runs the epilogue now.
    """
    if hs.depth == 0:
        return hs, (Event(EventKind.POST_HOOKS, note="skipped: no active backward"),)
    if ctx.running_engine_backward:
        return hs, (Event(EventKind.POST_HOOKS, note="deferred to engine.backward"),)
    hs, eff = backward_epilogue(hs, ctx)
    return hs, (Event(EventKind.POST_HOOKS, note="ran epilogue"),) + eff


def epilogue_if_engine_backward(hs: HookState, ctx: Ctx) -> Result:
    """``engine.backward`` returns: it calls ``_backward_epilogue`` itself (PyTorch-style does not)."""
    if ctx.running_engine_backward:
        return backward_epilogue(hs, ctx)
    return hs, ()


# ---------------------------------------------------------- gradient handling
def process_gradients(params: tuple[str, ...]) -> Effects:
    """``process_gradients`` / ``reduce_ready_partitions_and_remove_grads``: into the ipg bucket."""
    return tuple(Event(EventKind.BUCKET_ADD, param=p) for p in params)


def count_used(ctx: Ctx) -> tuple[int, Effects]:
    """``count_used_parameters_in_backward(...) (+ leaf_module_count under ZeRO-3)``: the expected count, and its
    COUNT (the function's own result) and EXPECTED (with the leaf modules) events."""
    value = ctx.expected_count()
    return value, (Event(EventKind.COUNT, task=ctx.task, value=value - ctx.net.leaf_module_count),
                   Event(EventKind.EXPECTED, task=ctx.task, value=value))


def queue_post_backward_callback(hs: HookState, ctx: Ctx) -> tuple[HookState, Effects, bool]:
    """``queue_post_backward_callback``: once per backward, only while a user backward is active."""
    if hs.cb_queued:
        return hs, (), True
    if hs.depth == 0 or ctx.task is None:
        return hs, (), False
    hs = hs.with_(cb_queued=True, cb_task=ctx.task)
    return hs, (Event(EventKind.CALLBACK_QUEUED, task=ctx.task),), True


def reenter_backward_if_needed(hs: HookState, ctx: Ctx) -> Result:
    """0.18.5+: a later reentrant phase after an epilogue re-enters the backward context."""
    if hs.remaining == 0 and hs.depth == 0 and hs.seen:
        # 0.18.7's resetting enter_backward never resets here: `seen` is already True.
        return enter_backward_mark_seen(hs, ctx)
    return hs, ()


def should_refresh_expected_hook_count(hs: HookState) -> bool:
    """0.18.7 (PR #7886): count only at a phase boundary (first hook, or a new reentrant phase)."""
    return hs.fired == 0 or (hs.remaining == 0 and hs.depth == 0 and hs.seen)


def update_hook_state_and_maybe_run_epilogue(hs: HookState, current: int, ctx: Ctx) -> Result:
    """0.18.5+: track the largest expected count; prefer the queued callback, else count down."""
    hs = hs.with_(fired=hs.fired + 1, max_expected=max(hs.max_expected, current))
    hs, eff, queued = queue_post_backward_callback(hs, ctx)
    if queued:
        return hs.with_(remaining=max(hs.max_expected - hs.fired, 0)), eff
    if hs.fired >= hs.max_expected:
        hs, more = run_post_hooks(hs.with_(remaining=0), ctx)
        return hs, eff + more
    return hs.with_(remaining=hs.max_expected - hs.fired), eff


# ------------------------------------------------- z3 leaf reduction deferred
def defer_leaf_reduction(hs: HookState, module: str, pending: tuple[str, ...]) -> Result:
    """zerostate (known issue z3-leaf-input-without-grad, docs/upstream/z3-leaf-input-without-grad/fix.patch):
    the leaf hook fired before ``pending``'s gradients accumulated; reduce once all of them have."""
    return hs.with_(deferred=hs.deferred + ((module, frozenset(pending)),)), ()


def leaf_grad_accumulated(hs: HookState, param: str) -> tuple[HookState, str | None]:
    """A leaf parameter's gradient accumulated: drop it from the deferral awaiting it.  Returns the leaf
    module whose last awaited gradient this was (its reduction runs now), else None."""
    for k, (module, left) in enumerate(hs.deferred):
        if param in left:
            rest = left - {param}
            if rest:
                return hs.with_(deferred=hs.deferred[:k] + ((module, rest),) + hs.deferred[k + 1:]), None
            return hs.with_(deferred=hs.deferred[:k] + hs.deferred[k + 1:]), module
    return hs, None


__all__ = [
    "backward_epilogue", "count_used", "defer_leaf_reduction", "enter_backward_mark_seen", "enter_backward_plain",
    "enter_backward_resetting", "leaf_grad_accumulated", "epilogue_if_engine_backward", "exit_backward", "keep",
    "process_gradients", "queue_post_backward_callback", "reenter_backward_if_needed",
    "reset_for_new_step", "run_post_hooks", "should_refresh_expected_hook_count",
    "update_hook_state_and_maybe_run_epilogue",
]
