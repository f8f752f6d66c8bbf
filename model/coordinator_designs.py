"""Coordinator designs: how each era releases parameters fetched by an activation-checkpoint recompute.

A design is a *value*: a `CoordinatorDesign` record whose flags choose among the named actions of
``coordinator_actions.py``.  All four share DeepSpeed 0.19.x's fetch / release / trace / prefetch
machinery and differ only where the source differs:

``ds-0.19.2``
    The recompute's post-forward hook releases what the recompute fetched, frozen parameters
    included.  Under a non-reentrant checkpoint a frozen parameter the recompute saved (a live
    reference) is partitioned before torch checks it: ``CheckpointError ... [1024] vs [0]`` (seed 002).
``pr-8130``
    Seed 002's fix, on 0.19.2: a forward release inside a graph task (a recompute) skips frozen
    parameters; the module's following backward releases them.  (Not merged.)
``ds-0.19.3``
    The merged fix (PR #8148, in 0.19.3 through 0.19.8): recompute-fetched frozen parameters are
    attributed to the innermost backward module in progress (``ds_recompute_parameters``) and released
    with it; ``backward_epilogue`` drains modules whose post-backward never fired
    (``release_backward_leftovers``).
``zerostate``
    Release each recompute-fetched parameter at its last use (DeepSpeed lists this as a known gap:
    the xfailed "release at last use" lifecycle tests of PR #8148).  On top of 0.19.3's backward map
    and epilogue drain, without its attribution: at the post-forward of a module inside a
    *non-reentrant* recompute whose output requires grad (its ops saved tensors; frozen parameters
    as live references), its frozen parameters -- persistent ones too, which DeepSpeed partitions
    while the trace is not COMPLETE -- are held until the module's own post-backward (the last use of
    the saved tensor) and released there by DeepSpeed's own release; anything else a recompute
    fetched is released by the recompute's post-forward hook, its last use (a reentrant recompute
    saves nothing live: its nested backward fetches again in place).  Holds whose module never runs
    its post-backward are drained at the epilogue and at the next root forward (persistent ones only
    dropped).  This is exactly ``runtime/release_policy.py`` (the hold decided at module granularity,
    from the recomputed output, as a forward hook sees it), checked hook by hook on real DeepSpeed by
    ``generated_tests/test_runtime_release_refinement.py``.  With a COMPLETE trace, the reuse walk
    of ``__params_to_release`` recurses into a later module exactly when that module is a z3 leaf
    (the fix of known issue ``z3-leaf-kept-gathered``; DeepSpeed decides by the module being released,
    so a released leaf's parameters all look reused and stay gathered).

Every design reacts to the driver events and to the hook half's EPILOGUE; it emits FETCH / PREFETCH /
RELEASE / HOLDERS / TRACE_STATE / PERSISTENT effect events (see ``events.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import coordinator_actions
from .coordinator_state import CoordState, index_for
from .events import Event, EventKind

if TYPE_CHECKING:
    from .machine import Ctx
    from .network import Network


@dataclass(frozen=True)
class CoordinatorDesign:
    name: str
    release: str
    """The first DeepSpeed release with this logic (or the PR / ``zerostate``)."""
    summary: str
    provenance: tuple[str, ...]
    track_stack: bool = False
    """0.19.3+: ``__active_backward_submodules`` and ``release_backward_leftovers`` at the epilogue."""
    attribute: bool = False
    """0.19.3: recompute-fetched frozen parameters attributed to the innermost backward module."""
    skip_frozen_in_recompute: bool = False
    """PR #8130: a forward release inside a graph task skips frozen parameters."""
    hold_recompute_frozen: bool = False
    """zerostate: hold frozen parameters a non-reentrant recompute saved live until their module's
    post-backward."""
    leaf_walk_fixed: bool = False
    """zerostate: ``__params_to_release`` walks a later module recursively when *it* is a z3 leaf (known
    issue z3-leaf-kept-gathered; DeepSpeed decides by the module being released)."""

    def initial(self, net: Network) -> CoordState:
        return CoordState.initial(index_for(net))

    def react(self, st: CoordState, ev: Event, ctx: Ctx) -> tuple[CoordState, tuple[Event, ...]]:
        """The one transition function of this half: ``(state, event) -> (state, effects)``."""
        handler = _HANDLERS.get(ev.kind)
        if handler is None or ctx.stage != 3:
            return st, ()
        index = index_for(ctx.net)
        if ev.module is not None and ev.kind not in _NO_MODULE and ev.module not in index.midx:
            return st, ()
        w = coordinator_actions.Work(st, index, ctx.net.scenario.prefetch_bucket_size)
        if not w.declared:
            coordinator_actions.declare_persistent(w)
        handler(self, w, ev)
        return w.freeze(), tuple(w.out)


# ------------------------------------------------------------------ handlers
def _module(w: coordinator_actions.Work, ev: Event) -> int:
    """The index of the hooked module a module-hook event names."""
    assert ev.module is not None, "a module hook event names its module"
    return w.index.midx[ev.module]


def _on_root_forward(d: CoordinatorDesign, w: coordinator_actions.Work, ev: Event) -> None:
    if d.hold_recompute_frozen:
        coordinator_actions.drain_holds(w)
    coordinator_actions.reset_step(w)


def _on_reregister(d: CoordinatorDesign, w: coordinator_actions.Work, ev: Event) -> None:
    coordinator_actions.reregister_hooks(w)
    coordinator_actions.unwrap_for_generation(w)  # GatheredParameters ends after the hooks are back


def _on_pre_forward(d: CoordinatorDesign, w: coordinator_actions.Work, ev: Event) -> None:
    coordinator_actions.pre_module_hook(w, _module(w, ev), True, ev.phase == "recompute",
                      track_stack=d.track_stack, attribute=d.attribute)


def _on_post_forward(d: CoordinatorDesign, w: coordinator_actions.Work, ev: Event) -> None:
    m = _module(w, ev)
    recompute = ev.phase == "recompute"
    if d.hold_recompute_frozen and recompute and w.index.nonreentrant[m] and w.index.output_requires_grad[m]:
        coordinator_actions.hold_recomputed_frozen(w, m)
    coordinator_actions.release_sub_module(w, m, True, recompute, track_stack=d.track_stack, attribute=d.attribute,
                         skip_frozen_in_recompute=d.skip_frozen_in_recompute, leaf_walk_fixed=d.leaf_walk_fixed)


def _on_pre_backward(d: CoordinatorDesign, w: coordinator_actions.Work, ev: Event) -> None:
    coordinator_actions.pre_module_hook(w, _module(w, ev), False, False, track_stack=d.track_stack,
                                        attribute=d.attribute)


def _on_post_backward(d: CoordinatorDesign, w: coordinator_actions.Work, ev: Event) -> None:
    m = _module(w, ev)
    if d.hold_recompute_frozen:
        coordinator_actions.drop_holds(w, m)
    coordinator_actions.release_sub_module(w, m, False, False, track_stack=d.track_stack, attribute=d.attribute,
                         skip_frozen_in_recompute=d.skip_frozen_in_recompute, leaf_walk_fixed=d.leaf_walk_fixed)


def _on_epilogue(d: CoordinatorDesign, w: coordinator_actions.Work, ev: Event) -> None:
    if d.track_stack:
        coordinator_actions.release_backward_leftovers(w)
    if d.hold_recompute_frozen:
        coordinator_actions.drain_holds(w)


def _on_step(d: CoordinatorDesign, w: coordinator_actions.Work, ev: Event) -> None:
    coordinator_actions.release_and_reset_all(w)


def _on_container(d: CoordinatorDesign, w: coordinator_actions.Work, ev: Event) -> None:
    """A ``Block`` container's hook: the same DeepSpeed functions as any module's (it owns no parameter,
    so it fetches and releases nothing, but it is traced, counts a step and, with a COMPLETE trace,
    pops the queue and prefetches)."""
    _CONTAINER_HANDLERS[ev.note](d, w, ev)


_CONTAINER_HANDLERS: dict[str | None, Callable[[CoordinatorDesign, coordinator_actions.Work, Event], None]] = {
    "pre_forward": _on_pre_forward, "post_forward": _on_post_forward,
    "pre_backward": _on_pre_backward, "post_backward": _on_post_backward,
}

_HANDLERS: dict[EventKind, Callable[[CoordinatorDesign, coordinator_actions.Work, Event], None]] = {
    EventKind.CONTAINER_HOOK: _on_container,
    EventKind.FORWARD_START: _on_root_forward,
    EventKind.EVAL_FORWARD_START: _on_root_forward,
    EventKind.REREGISTER: _on_reregister,
    EventKind.MODULE_PRE_FORWARD: _on_pre_forward,
    EventKind.MODULE_POST_FORWARD: _on_post_forward,
    EventKind.MODULE_PRE_BACKWARD: _on_pre_backward,
    EventKind.MODULE_POST_BACKWARD: _on_post_backward,
    EventKind.EPILOGUE: _on_epilogue,
    EventKind.STEP: _on_step,
}
_NO_MODULE = frozenset({EventKind.FORWARD_START, EventKind.EVAL_FORWARD_START, EventKind.REREGISTER,
                        EventKind.EPILOGUE, EventKind.STEP})

_DS = "deepspeed/runtime/zero/partitioned_param_coordinator.py"

DS_0_19_2 = CoordinatorDesign(
    "ds-0.19.2", "0.19.2",
    "recompute post-forward hooks partition frozen params a non-reentrant checkpoint saved (seed 002)",
    (f"DeepSpeed 0.19.2 {_DS}", "seed 002"))
PR_8130 = CoordinatorDesign(
    "pr-8130", "PR #8130",
    "seed 002's fix: recompute forward releases skip frozen params; their module's backward releases them",
    ("deepspeedai/DeepSpeed#8130 (not merged)", "seed 002"),
    skip_frozen_in_recompute=True)
DS_0_19_3 = CoordinatorDesign(
    "ds-0.19.3", "0.19.3",
    "merged fix: recompute-fetched frozen params attributed to the backward module in progress; "
    "leftovers drained at the epilogue",
    (f"DeepSpeed 0.19.3 {_DS}", "deepspeedai/DeepSpeed#8148", "seed 002"),
    track_stack=True, attribute=True)
ZEROSTATE = CoordinatorDesign(
    "zerostate", "zerostate",
    "release at last use: frozen params a non-reentrant recompute saved live are held until their own "
    "module's post-backward; nothing else is held; no attribution; leftovers drained",
    ("zerostate runtime/release_policy.py", "seed 002", "deepspeedai/DeepSpeed#8148 (xfailed last-use tests)"),
    track_stack=True, hold_recompute_frozen=True, leaf_walk_fixed=True)

COORDINATOR_DESIGNS: dict[str, CoordinatorDesign] = {
    d.name: d for d in (DS_0_19_2, PR_8130, DS_0_19_3, ZEROSTATE)}

__all__ = ["COORDINATOR_DESIGNS", "CoordinatorDesign", "DS_0_19_2", "DS_0_19_3", "PR_8130", "ZEROSTATE"]
