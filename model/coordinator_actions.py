"""The named actions of the ZeRO-3 parameter coordinator, one per DeepSpeed method.

An action works on a `Work`: a scratch copy of one `CoordState` for the duration of a single
reaction, which collects the effect events it causes.  ``Work(state, index) -> actions ->
work.freeze()`` is a pure function of the state and the event: nothing outside the scratch copy
is touched.  Designs (``coordinator_designs.py``) choose which actions run for which event.

Sources: ``deepspeed/runtime/zero/partitioned_param_coordinator.py`` (PPC),
``parameter_offload.py`` and ``stage3.py`` of DeepSpeed 0.19.2 and 0.19.3 (0.19.8 is 0.19.3 here),
PR #8130 (seed 002) and the zerostate runtime's release policy (``runtime/release_policy.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from .coordinator_state import (AVAILABLE, COMPLETE, HOLD, HOLD_NAME, INFLIGHT, INVALID, MODE_NAMES, NEVER,
                                NOT_AVAILABLE, RECORD, CoordIndex, CoordState)
from .events import Event, EventKind


class CoordinatorError(RuntimeError):
    """DeepSpeed itself would raise here (e.g. PPC's "tracing error" when the fetch queue is out of step)."""


class Work:
    """A mutable scratch copy of one `CoordState`, plus the effect events of the reaction so far."""

    __slots__ = ("index", "status", "holders", "mode", "step_id", "order", "queue", "fetched_for", "cache",
                 "stack", "recompute", "held", "declared", "out", "prefetch_bucket", "live")

    def __init__(self, st: CoordState, index: CoordIndex, prefetch_bucket: int = 0):
        self.index = index
        self.status = list(st.status)
        self.holders = list(st.holders)
        self.mode = st.mode
        self.step_id = st.step_id
        self.order = st.order
        self.queue = st.queue
        self.fetched_for = list(st.fetched_for)
        self.cache = st.cache
        self.stack = list(st.stack)
        self.recompute = dict(st.recompute)
        self.held = dict(st.held)
        self.declared = st.declared
        self.live = st.live
        self.out: list[Event] = []
        self.prefetch_bucket = prefetch_bucket

    def freeze(self) -> CoordState:
        return CoordState(tuple(self.status), tuple(self.holders), self.mode, self.step_id, self.order,
                          self.queue, tuple(self.fetched_for), self.cache, tuple(self.stack),
                          tuple(sorted(self.recompute.items())), tuple(sorted(self.held.items())), self.declared,
                          self.live)

    # names for events
    def param_name(self, i: int) -> str:
        return self.index.params[i]

    def module_name(self, i: int | None) -> str | None:
        if i is None:
            return None
        return HOLD_NAME if i == HOLD else self.index.modules[i]


# ----------------------------------------------------------------- primitives
def declare_persistent(w: Work) -> None:
    """``mark_persistent_parameters`` (parameter_offload.py): parameters of at most
    ``stage3_param_persistence_threshold`` elements get ``ds_persist``; said once to the trace."""
    w.declared = True
    w.out += [Event(EventKind.PERSISTENT, param=w.param_name(i)) for i in range(w.index.n) if w.index.persistent[i]]


def hold(w: Work, p: int, m: int) -> None:
    """``param.ds_active_sub_modules.add(module.ds_id)``."""
    if m not in w.holders[p]:
        w.holders[p] = w.holders[p] | {m}
        w.out.append(Event(EventKind.HOLDERS, param=w.param_name(p), module=w.module_name(m),
                           value=len(w.holders[p]), note="+"))


def drop(w: Work, p: int, m: int) -> None:
    """``param.ds_active_sub_modules.discard(module.ds_id)``."""
    if m in w.holders[p]:
        w.holders[p] = w.holders[p] - {m}
        w.out.append(Event(EventKind.HOLDERS, param=w.param_name(p), module=w.module_name(m),
                           value=len(w.holders[p]), note="-"))


def release_param(w: Work, p: int, m: int | None) -> None:
    """PPC ``__release_param``: partition (``param.data = empty(0)``) only an AVAILABLE parameter that
    no module holds.  Persistent parameters are *not* exempt here: callers decide (the trace-driven
    ``__params_to_release`` skips them; the RECORD/INVALID path and ``release_and_reset_all`` do not)."""
    if w.status[p] == AVAILABLE and not w.holders[p]:
        w.status[p] = NOT_AVAILABLE
        w.live -= w.index.numel[p]
        w.out.append(Event(EventKind.RELEASE, param=w.param_name(p), module=w.module_name(m)))


def wait_inflight(w: Work, p: int, m: int | None) -> None:
    """``__inflight_param_registry.pop(param).wait()``: an in-flight all-gather completes."""
    if w.status[p] == INFLIGHT:
        w.status[p] = AVAILABLE
        w.out.append(Event(EventKind.FETCH, param=w.param_name(p), module=w.module_name(m), note="inflight"))


def all_gather(w: Work, params: Iterable[int], m: int | None, prefetch: bool = False,
               counted: bool = True) -> None:
    """PPC ``__all_gather_params`` for module ``m`` (None: outside any module hook): gather the NOT_AVAILABLE
    ones.  A fetch waits on them right away (FETCH: AVAILABLE); a prefetch leaves them INFLIGHT (PREFETCH).
    ``counted``: through the coordinator (``__n_available_params`` grows), not ``param.all_gather`` called by
    the optimizer."""
    for p in params:
        if w.status[p] == NOT_AVAILABLE:
            if counted:
                w.live += w.index.numel[p]
            w.status[p] = INFLIGHT if prefetch else AVAILABLE
            w.out.append(Event(EventKind.PREFETCH if prefetch else EventKind.FETCH, param=w.param_name(p),
                               module=w.module_name(m)))


def set_mode(w: Work, mode: int, value: int | None) -> None:
    w.mode = mode
    w.out.append(Event(EventKind.TRACE_STATE, note=MODE_NAMES[mode], value=value))


# ---------------------------------------------------------------------- trace
def clean_inflight_param_registry(w: Work) -> None:
    """PPC ``_clean_inflight_param_registry``: wait every in-flight all-gather, then ``__release_param``."""
    for p in range(w.index.n):
        if w.status[p] == INFLIGHT:
            wait_inflight(w, p, None)
            release_param(w, p, None)


def invalidate_trace(w: Work) -> None:
    """PPC ``_invalidate_trace``: mode INVALID, ``_clear_trace_structures`` (module and parameter
    trace, fetch queue, most-recent-fetch steps), then clean the in-flight registry.  The
    ``__params_to_release`` lru_cache is *not* cleared (it never is)."""
    set_mode(w, INVALID, w.step_id)
    w.order = ()
    w.queue = 0
    w.fetched_for = [NEVER] * w.index.n
    clean_inflight_param_registry(w)


def reset_step(w: Work) -> None:
    """PPC ``reset_step``, run by the root module's forward pre-hook (``_start_of_forward_hook``) at every
    root forward, train or eval: clean the in-flight registry; RECORD becomes COMPLETE
    (``construct_parameter_trace_from_module_trace``), INVALID becomes RECORD; rewind the fetch queue
    and the step counter."""
    clean_inflight_param_registry(w)
    if w.mode == RECORD:
        set_mode(w, COMPLETE, len(w.order))
    elif w.mode == INVALID:
        w.order = ()
        set_mode(w, RECORD, None)
    w.queue = 0
    w.fetched_for = [NEVER] * w.index.n
    w.step_id = 0
    w.live = 0


def trace_prologue(w: Work, m: int) -> None:
    """PPC ``trace_prologue``: with a COMPLETE trace, a module other than the one recorded at this step
    (or one past the trace's end) invalidates it."""
    if w.mode == COMPLETE and (w.step_id >= len(w.order) or w.order[w.step_id] != m):
        invalidate_trace(w)


def record_module(w: Work, m: int) -> None:
    """PPC ``record_module`` (RECORD only): append the module to the trace."""
    if w.mode == RECORD:
        w.order = w.order + (m,)


def unwrap_for_generation(w: Work) -> None:
    """TRL's ``unwrap_model_for_generation`` around a re-registration (`TrainStep.reregister`): its
    ``remove_hooks`` clears every parameter's ``ds_active_sub_modules``; ``GatheredParameters`` over every
    parameter gathers the partitioned ones for the generation and, on exit, partitions every one --
    persistent ones too (on 0.19.7 and 0.19.8, after the unwrap, the next forward fetches a
    persistent parameter in its module's pre-forward hook).  A parameter partitioned before ends as it was;
    one gathered before (persistent, or in flight) is released.  Outside the coordinator: its count of
    available parameters is left as it was."""
    for p in range(w.index.n):
        for m in sorted(w.holders[p]):
            drop(w, p, m)
        if w.status[p] != NOT_AVAILABLE:
            w.status[p] = NOT_AVAILABLE
            w.out.append(Event(EventKind.RELEASE, param=w.param_name(p), note="unwrap"))


def reregister_hooks(w: Work) -> None:
    """``_register_deepspeed_module(root)`` (parameter_offload.py, 0.19.2 and 0.19.3): re-registering the
    hooks invalidates a trace that is not already INVALID."""
    if w.mode != INVALID:
        invalidate_trace(w)


# ---------------------------------------------------------------------- fetch
def push_backward_module(w: Work, m: int) -> None:
    """0.19.3 PPC ``fetch_sub_module`` (backward): ``__active_backward_submodules[ds_id] = module``
    (a dict: a module already in it keeps its place)."""
    if m not in w.stack:
        w.stack.append(m)


def attribute_to_backward_module(w: Work, p: int) -> None:
    """0.19.3 ``update_recompute_parameters`` (PR #8148): a frozen parameter fetched by a forward hook
    inside a graph task (a checkpoint recompute) while some backward module is in progress is added to
    the innermost one's ``ds_recompute_parameters`` and held by it."""
    if w.stack and w.index.frozen[p]:
        top = w.stack[-1]
        w.recompute[top] = w.recompute.get(top, frozenset()) | {p}
        hold(w, p, top)


def pop_own_trace_entries(w: Work, m: int, params: tuple[int, ...]) -> None:
    """PPC ``_fetch_sub_module_impl`` (COMPLETE): pop this module's parameters off the fetch queue,
    noting the step each was recorded at; a mismatch is DeepSpeed's "tracing error"."""
    trace = w.index.param_trace(w.order)
    wanted = {p for p in params if w.fetched_for[p] < w.step_id}
    got: set[int] = set()
    while w.queue < len(trace) and len(got) < len(wanted):
        p, s = trace[w.queue]
        w.queue += 1
        w.fetched_for[p] = s
        got.add(p)
    if got != wanted:
        raise CoordinatorError(f"tracing error at step {w.step_id}: module {w.module_name(m)} expected "
                               f"{sorted(w.param_name(p) for p in wanted)} next in the fetch queue, got "
                               f"{sorted(w.param_name(p) for p in got)}")


def prefetch(w: Work, m: int) -> None:
    """PPC ``_fetch_sub_module_impl`` (COMPLETE, ``stage3_prefetch_bucket_size`` > 0): walk the fetch queue
    until a bucket's worth of NOT_AVAILABLE parameters is found and all-gather them (INFLIGHT).  Entries
    skipped because the parameter is already gathered still mark its next use
    (``__most_recent_step_id_param_fetched_for``), which stops its release before that use.
    The bucket is capped by ``stage3_max_live_parameters`` minus the elements the coordinator holds
    gathered (``__n_available_params``): at or above it nothing is prefetched."""
    if w.prefetch_bucket <= 0:
        return
    trace = w.index.param_trace(w.order)
    chosen: list[int] = []
    numel = 0
    budget = min(w.index.max_live_parameters - w.live, w.prefetch_bucket)
    while w.queue < len(trace) and numel < budget:
        p, s = trace[w.queue]
        w.queue += 1
        go = w.status[p] == NOT_AVAILABLE and p not in chosen
        w.fetched_for[p] = max(w.fetched_for[p], s)
        if go:
            chosen.append(p)
            numel += w.index.numel[p]
    all_gather(w, chosen, m, prefetch=True)


def fetch_sub_module(w: Work, m: int, forward: bool, in_recompute: bool, *, track_stack: bool,
                     attribute: bool) -> None:
    """PPC ``fetch_sub_module`` (run by every module's pre-forward and pre-backward hook): gather the
    module's NOT_AVAILABLE parameters, hold them for the module, wait for in-flight ones; with a
    COMPLETE trace pop the queue and prefetch; count the step.  ``track_stack``/``attribute``: 0.19.3's
    backward-module map and recompute attribution."""
    if not forward and track_stack:
        push_backward_module(w, m)
    params = w.index.module_params[m]
    all_gather(w, params, m)
    for p in params:
        hold(w, p, m)
        if attribute and forward and in_recompute:
            attribute_to_backward_module(w, p)
        wait_inflight(w, p, m)
    if w.mode == COMPLETE:
        pop_own_trace_entries(w, m, params)
        prefetch(w, m)
    w.step_id += 1


def pre_module_hook(w: Work, m: int, forward: bool, in_recompute: bool, *, track_stack: bool,
                    attribute: bool) -> None:
    """``pre_sub_module_forward_function`` / ``pre_sub_module_backward_function`` (parameter_offload.py):
    ``trace_prologue``, ``record_module`` when recording, then ``fetch_sub_module``."""
    trace_prologue(w, m)
    record_module(w, m)
    fetch_sub_module(w, m, forward, in_recompute, track_stack=track_stack, attribute=attribute)


# -------------------------------------------------------------------- release
def params_to_release(w: Work, m: int, leaf_walk_fixed: bool = False) -> frozenset[int]:
    """PPC ``__params_to_release(module, step_id)`` (COMPLETE only): the module's non-persistent parameters
    except those whose next use a prefetch already walked past, and those used again by a module recorded
    within ``stage3_max_reuse_distance`` elements after this step (the walk over ``__submodule_order[step_id:]``
    stops once the elements traversed reach the distance; default 1e9: any later use keeps it gathered).
    The walk reads each later module's ``iter_params(recurse=z3_leaf_module(m))``: the leaf-ness of the
    module *being released* decides, so a leaf module sees every parameter under the root (known issue
    ``z3-leaf-kept-gathered``).  ``leaf_walk_fixed`` (zerostate, docs/upstream/z3-leaf-kept-gathered/fix.patch):
    each later module is walked recursively exactly when *it* is a leaf.  Memoised by ``functools.lru_cache``
    on (module, step_id) for the coordinator's lifetime."""
    key = (m, w.step_id)
    for k, v in w.cache:
        if k == key:
            return v
    index = w.index
    keep = {p for p in index.module_params[m] if index.persistent[p] or w.fetched_for[p] > w.step_id}
    walk = index.iter_params[m in index.leaf_modules]
    traversed = 0
    for later in w.order[w.step_id:]:
        if traversed >= index.max_reuse_distance:
            break
        if leaf_walk_fixed:
            walk = index.iter_params[later in index.leaf_modules]
        for p in walk[later]:
            keep.add(p)
            traversed += index.numel[p]
    got = frozenset(p for p in index.module_params[m] if p not in keep)
    w.cache = w.cache + ((key, got),)
    return got


def release_sub_module(w: Work, m: int, forward: bool, in_recompute: bool, *, track_stack: bool,
                       attribute: bool, skip_frozen_in_recompute: bool, leaf_walk_fixed: bool = False) -> None:
    """PPC ``release_sub_module`` (post-forward and post-backward hooks): drop the module's hold on its
    parameters and partition those meant for release that no one else holds.  Without a COMPLETE trace
    every parameter of the module is meant for release, persistent ones included.  0.19.3 (backward):
    also the module's ``ds_recompute_parameters`` (non-persistent), and the module leaves the backward map.
    PR #8130 (``skip_frozen_in_recompute``): a forward release inside a graph task skips frozen params."""
    ptr = params_to_release(w, m, leaf_walk_fixed) if w.mode == COMPLETE else frozenset(w.index.module_params[m])
    params = set(w.index.module_params[m])
    if not forward and attribute:
        extra = w.recompute.pop(m, frozenset())
        ptr = ptr | {p for p in extra if not w.index.persistent[p]}
        params |= extra
    if not forward and track_stack and m in w.stack:
        w.stack.remove(m)
    for p in sorted(params):
        drop(w, p, m)
        if p not in ptr:
            continue
        if skip_frozen_in_recompute and forward and in_recompute and w.index.frozen[p]:
            continue
        release_param(w, p, m)


def release_backward_leftovers(w: Work) -> None:
    """0.19.3 ``release_backward_leftovers`` (stage3 ``backward_epilogue``, PR #8148): drain the backward
    map last-in first-out, releasing each module's parameters and ``ds_recompute_parameters`` as its
    missing post-backward hook would have (persistent ones skipped)."""
    while w.stack:
        m = w.stack.pop()
        for p in sorted(set(w.index.module_params[m]) | w.recompute.pop(m, frozenset())):
            drop(w, p, m)
            if not w.index.persistent[p]:
                release_param(w, p, m)


def release_and_reset_all(w: Work) -> None:
    """``engine.step()`` -> stage3 ``step`` -> ``_partition_all_parameters`` -> PPC
    ``release_and_reset_all``: wait in-flight all-gathers, clear every parameter's holders and partition
    it (persistent ones too); then ``_post_step`` all-gathers the persistent parameters again.  The
    0.19.3 backward map and recompute sets are left as they are."""
    for p in range(w.index.n):
        wait_inflight(w, p, None)
        for h in sorted(w.holders[p]):
            drop(w, p, h)
        release_param(w, p, None)
    all_gather(w, [p for p in range(w.index.n) if w.index.persistent[p]], None,
               counted=False)  # stage3 _post_step: param.all_gather, not the coordinator's


# ------------------------------------------------------ zerostate hold policy
def hold_recomputed_frozen(w: Work, m: int) -> None:
    """zerostate (``runtime/release_policy.py``'s ``release_sub_module``, forward): at the post-forward of
    module ``m`` inside a *non-reentrant* recompute whose output requires grad, its ops saved their
    tensors for backward -- frozen parameters as live references (torch keeps ``x.detach() if
    x.requires_grad else x``; seed 002).  Hold every frozen parameter of ``m`` that is AVAILABLE for
    ``m``'s backward, its last use, so no release partitions it before the metadata check and that
    backward.  Persistent parameters are held too: while the trace is not COMPLETE (the first step, and
    after every invalidation) ``release_sub_module`` partitions persistent parameters like any other
    (at DeepSpeed's default threshold 1e5 this is seed 002 on 0.19.0-0.19.2).

    Module granularity, as the runtime sees it: "its output requires grad" is what a forward hook can
    observe.  For a frozen sub-module that is exactly "its ops saved its parameters" (SAVE_LIVE); for a
    z3 leaf block mixing frozen and trainable parameters it may hold a frozen parameter that was not
    saved (harmless: released at the block's post-backward).  A reentrant recompute saves nothing live
    (its nested backward re-fetches in place), so nothing is held there."""
    held = w.held.get(m, frozenset())
    for p in w.index.module_params[m]:
        if w.index.frozen[p] and w.status[p] == AVAILABLE and HOLD not in w.holders[p]:
            hold(w, p, HOLD)
            held = held | {p}
    if held:
        w.held[m] = held


def drop_holds(w: Work, m: int) -> None:
    """zerostate: at the module's post-backward (the last use of what its recompute saved), drop its holds
    just before DeepSpeed's own release, which then decides as usual."""
    for p in sorted(w.held.pop(m, frozenset())):
        drop(w, p, HOLD)


def drain_holds(w: Work) -> None:
    """zerostate leak guard: after the backward epilogue and before ``reset_step``, drop every hold whose
    module never ran its post-backward and release what no one else holds (persistent ones excepted)."""
    for m in sorted(w.held):
        for p in sorted(w.held[m]):
            drop(w, p, HOLD)
            if not w.index.persistent[p]:
                release_param(w, p, m)
    w.held = {}


__all__ = [
    "CoordinatorError", "Work", "all_gather", "attribute_to_backward_module", "clean_inflight_param_registry",
    "declare_persistent", "drain_holds", "drop", "drop_holds", "fetch_sub_module", "hold", "hold_recomputed_frozen",
    "invalidate_trace", "params_to_release", "pop_own_trace_entries", "pre_module_hook", "prefetch",
    "push_backward_module", "record_module", "release_and_reset_all", "release_backward_leftovers",
    "release_param", "release_sub_module", "reregister_hooks", "reset_step", "trace_prologue",
    "unwrap_for_generation", "wait_inflight",
]
