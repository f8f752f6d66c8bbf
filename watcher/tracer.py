"""The watch's tracer: `TraceCore` on a user's own model, under the user's names, events queued for the checker.

`WatchTracer` composes the core (`zerostate.tracing.core`: DeepSpeed's hook lifecycle, graph tasks, parameter
statuses) with a view of any model (`UserModelView`) and a queue sink (`QueueSink`), and adds what a job it did
not build needs:

* the module hooks of *every* module DeepSpeed hooks, under the user's names (the root as ``model``), with the
  phase (forward / recompute / eval); a z3 leaf module's gradient hook named by the leaf module owning the
  parameter;
* the training loop from the engine's own calls: ``engine.forward`` (FORWARD_START/END, or EVAL_FORWARD_* under
  ``no_grad`` / ``eval()``), ``engine.backward`` (USER_BACKWARD_START/END, kind ``engine``), ``engine.step`` at the
  accumulation boundary (STEP), a PyTorch-style ``loss.backward()`` (`zerostate.watcher.torch_observers`);
* hooks registered again on the root after the engine was built (TRL's unwrap for generation): REREGISTER;
* ``torch.utils.checkpoint``'s non-reentrant machinery (`zerostate.watcher.torch_observers`): RECOMPUTE_START/END,
  SAVE_LIVE, UNPACK (check / use) -- what seed 002 breaks;
* what the report needs beside the events: recomputes observed and not (reentrant), and the parameters a backward
  left gathered by a module whose post-backward never ran (`WatchTracer.backward_leftovers`).
"""

from __future__ import annotations

import collections
import threading
from typing import Any
from collections.abc import Callable

import torch

from zerostate.model.events import Event, EventKind

from zerostate.tracing import compat
from zerostate.tracing.core import MODULE_HOOK_KINDS, ROOT, TraceCore, Wrapper
from zerostate.watcher.torch_observers import ACTIVE, checkpointed_module, install_observers, uninstall_observers

_GATHER = "_PartitionedParameterCoordinator__all_gather_params"
"""partitioned_param_coordinator.py ``__all_gather_params(params, forward)`` (0.18.4-0.19.8): every fetch and
prefetch all-gathers through it."""
_EVENTS: dict[tuple, Event] = {}
"""(kind, param, module, task, value, phase, note) -> the one `Event` with those fields."""
_EVENTS_MAX = 200_000
BATCH = 256
"""Events a tracer holds before it hands them to its sink (`WatchTracer.deliver`)."""
WATCH_START = "watch-start"
"""The note of the FETCH / PREFETCH events that report what was gathered when watching began."""


def z3_leaf_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The z3 leaf modules of ``module`` (``deepspeed.utils.set_z3_leaf_modules`` sets ``_z3_leaf``)."""
    return {(n or ROOT): m for n, m in module.named_modules() if getattr(m, "_z3_leaf", False)}


class QueueSink:
    """Events queued as shared `Event` objects (a job repeats the same ones every step: the online checker's
    transition memo keys on the object), handed to ``deliver_to`` every `BATCH` events and on demand."""

    def __init__(self, deliver_to: Callable[[collections.deque[Event]], None] | None) -> None:
        self.deliver_to = deliver_to
        self.queue: collections.deque[Event] = collections.deque()
        self._delivering = False
        self._lock = threading.RLock()

    def put(self, kind: EventKind, param: str | None, module: str | None, task: int | None, value: Any,
            phase: str | None, note: str | None) -> None:
        if self.deliver_to is None:
            return
        key = (kind, param, module, task, value, phase, note)
        ev = _EVENTS.get(key)
        if ev is None:
            if len(_EVENTS) >= _EVENTS_MAX:
                _EVENTS.clear()
            ev = _EVENTS[key] = Event(kind, param, module, task, value, phase, note)
        q = self.queue
        q.append(ev)  # (a deque: appends from another thread while `deliver` runs are neither lost nor reordered)
        if len(q) >= BATCH:
            self.deliver()

    def deliver(self) -> None:
        """Hand every queued event over, in order.  A call made while the checker runs (a violation writes the
        report, which asks for delivery) returns at once: the outer call goes on."""
        if self._delivering or self.deliver_to is None:
            return
        with self._lock:
            if self._delivering:
                return
            self._delivering = True
            try:
                self.deliver_to(self.queue)  # it takes them from the left (an interrupted fold leaves the rest queued)
            finally:
                self._delivering = False


class UserModelView:
    """A user's model seen by the core: every hooked module under its own name, z3 leaf modules, what each module
    fetches, and the bookkeeping of the report (recomputes, modules whose post-backward never ran)."""

    def __init__(self, core: TraceCore) -> None:
        self.core = core
        module = core.module
        self.leaves = z3_leaf_modules(module) if core.stage == 3 else {}
        self.leaf_count = sum(1 for m in self.leaves.values() if any(p.requires_grad for p in m.parameters()))
        self._leaf_of: dict[str, str] = {}
        for lname, m in self.leaves.items():
            prefix = "" if lname == ROOT else lname + "."
            for pn, _ in m.named_parameters():
                self._leaf_of.setdefault(prefix + pn, lname)
        self.own: dict[str, tuple[str, ...]] = {}
        for raw, m in module.named_modules():
            mname = raw or ROOT
            prefix = "" if mname == ROOT else mname + "."
            self.own[mname] = tuple(prefix + pn for pn, _ in m.named_parameters(recurse=mname in self.leaves))
        self._by_name = dict(core.params)
        self._own_items = {m: [(n, self._by_name[n]) for n in ns if n in self._by_name] for m, ns in self.own.items()}
        """module -> its own (name, parameter) pairs in parameter order (`poll_module`'s usual scan)."""
        self._own_sets = {m: frozenset(ns) for m, ns in self.own.items()}
        self._order = {n: i for i, (n, _) in enumerate(core.params)}
        self.dirty: set[str] = set()
        """Parameters all-gathered since the last poll."""
        self.gather_seen = False
        """The coordinator's all-gather is wrapped (else every module hook scans every parameter)."""
        self.recompute_depth = 0
        self.recomputes_observed = 0
        """Non-reentrant checkpoint recomputes (torch's ``_run_fn_with_dynamo_disabled``, observed in full)."""
        self.recomputes_unobserved = 0
        """Module pre-forwards inside a backward outside those: a reentrant checkpoint's recompute (or a forward in
        a custom backward), whose saved tensors the watch does not observe."""
        self.step = 0
        """The train step the job is in (0-based; the tracer advances it at each accumulation boundary)."""
        self.recompute_steps: dict[str, tuple[int, int]] = {}
        """``non-reentrant`` / ``reentrant`` -> (first, last) train step it was seen in: a trainer that enables
        checkpointing again with other settings mid-job switches kinds."""
        self.on_root_forward: Callable[[torch.nn.Module, bool], None] | None = None
        """Called at the root module's pre-forward (True) and post-forward (False) outside a backward."""
        self.bwd_pre: dict[str, torch.nn.Module] = {}
        """Modules whose pre-backward ran in the current user backward (name -> module)."""
        self.bwd_post: set[str] = set()

    def saw_recompute(self, kind: str) -> None:
        first, _ = self.recompute_steps.get(kind, (self.step, self.step))
        self.recompute_steps[kind] = (first, self.step)

    def leaf_module_of(self, param: str) -> str:
        """The user's z3 leaf module holding ``param`` (any depth), else the parameter's own module."""
        return self._leaf_of.get(param, param.rsplit(".", 1)[0])

    def module_hook(self, what: str, f: Wrapper) -> Wrapper:
        view, c = self, self.core
        kind = MODULE_HOOK_KINDS[what]
        forward = what in ("pre_forward", "post_forward")
        pre_fwd = what == "pre_forward"
        names = c.mod_names
        pre_bwd = self.bwd_pre if what == "pre_backward" else None
        post_bwd = self.bwd_post if what == "post_backward" else None
        root_fwd = True if pre_fwd else False if what == "post_forward" else None

        def wrapped(module: torch.nn.Module, *a: Any, **k: Any) -> Any:
            task = c.task()
            name = names.get(id(module), "?")
            if root_fwd and name == ROOT and task is None and view.on_root_forward is not None:
                view.on_root_forward(module, True)
            if pre_bwd is not None:
                pre_bwd[name] = module
            elif post_bwd is not None:
                post_bwd.add(name)
            phase = None
            if forward:
                phase = "eval" if c.eval else ("recompute" if task is not None else "forward")
                if task is not None and pre_fwd and not view.recompute_depth:
                    view.recomputes_unobserved += 1  # a reentrant checkpoint's (or a custom backward's) forward
                    view.saw_recompute("reentrant")
            c.poll_trace()
            c.emit(kind, None, name, None, None, phase)
            r = f(module, *a, **k)
            if c.trace_changed():  # an invalidation waits on or releases other modules' prefetches: scan them all
                c.poll(name)
            else:
                view.poll_module(name)
            if root_fwd is False and name == ROOT and task is None and view.on_root_forward is not None:
                view.on_root_forward(module, False)
            return r
        return wrapped

    def poll_module(self, module: str | None, extra: tuple[str, ...] = ()) -> None:
        """After a module hook: only the module's own parameters (what its fetch / release touches) and those
        all-gathered since the last poll (prefetches, external parameters) can have changed -- DeepSpeed's other
        releases (``release_and_reset_all``) run in the epilogue and step, and an invalidated trace's cleanup of
        other modules' prefetches comes with a trace-mode change: there the core's `poll` scans all.
        Scanning all ~P parameters after each of ~M module hooks made watching O(M x P) per step."""
        c = self.core
        if c.stage != 3 or c.paused_depth:
            return
        if not self.gather_seen:
            c.poll(module)
            return
        dirty = self.dirty
        own = self._own_items.get(module, ()) if module is not None else ()
        if not extra and (not dirty or dirty.issubset(self._own_sets[module] if own else ())):  # type: ignore[index]
            dirty.clear()  # the usual hook: only the module's own parameters were all-gathered
            c.scan(own, module)
            return
        names = set(self.own.get(module, ()) if module is not None else ()) | dirty | set(extra)
        dirty.clear()
        c.scan([(n, self._by_name[n]) for n in sorted(names, key=self._order.__getitem__) if n in self._by_name],
               module)

    def leftovers(self) -> dict[str, str]:
        """Parameters of modules whose pre-backward ran and post-backward did not (torch calls a module's backward
        hook only when an input requires grad: token ids never do) still gathered or held now."""
        out: dict[str, str] = {}
        c = self.core
        if c.stage != 3:
            return out
        for name, mod in self.bwd_pre.items():
            if name in self.bwd_post:
                continue
            external = getattr(mod, "ds_external_parameters", None)
            params = [p for _, p in mod.named_parameters(recurse=name in self.leaves)]
            params += [p for _, p in external()] if callable(external) else []
            for p in params:
                full = c.param_names.get(id(p))
                if full and (compat.param_status(p) != "NOT_AVAILABLE" or compat.holders(p)):
                    out.setdefault(full, name)
        return out


class WatchTracer:
    """The tracer of one watched engine.  ``sink(queue)`` receives every event, in order (`QueueSink`): when
    `BATCH` events are queued, and whenever the owner asks (`deliver`: `zerostate.watcher.watch.WatchHandle` does
    at the end of every engine call and before it reads or writes what the checker found).  No list of the run's
    events is kept."""

    def __init__(self, engine: Any, sink: Callable[[collections.deque[Event]], None] | None = None) -> None:
        stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0
        self.engine = engine
        self._sink = QueueSink(sink)
        self.core = TraceCore(engine, stage, self._sink)
        self.view = UserModelView(self.core)
        self.stage = stage
        self.param_names = self.core.param_names
        self.mod_names = self.core.mod_names
        self.leaves = self.view.leaves
        self.leaf_inputs: dict[str, bool] = {}
        """z3 leaf module -> whether any tensor input required grad at its last forward."""
        self._handles: list[Any] = []
        self.steps = 0
        self.backwards = 0
        self.engine_calls = 0
        """engine.forward / engine.backward calls in progress (a backward made there is not the user's own)."""
        self._plain: str | None = None
        """The kind (``torch`` / ``nonscalar``) of a PyTorch-style backward in progress whose window is not open."""
        self._plain_open: str | None = None
        self._direct: list[str] = []
        """The end marks owed by root-module forwards called outside ``engine.forward`` (innermost last)."""
        self.view.on_root_forward = self._root_forward
        self.backward_leftovers: dict[str, str] = {}
        """After the last user backward: parameter -> the module whose pre-backward fetched it and whose
        post-backward never ran, for parameters still gathered or held then (what 0.19.3's epilogue drains)."""

    # ------------------------------------------------------------ what the handle reads
    @property
    def on_trace_sync(self) -> Callable[[], None] | None:
        return self.core.on_trace_sync

    @on_trace_sync.setter
    def on_trace_sync(self, fn: Callable[[], None] | None) -> None:
        self.core.on_trace_sync = fn

    @property
    def recomputes_observed(self) -> int:
        return self.view.recomputes_observed

    @property
    def recomputes_unobserved(self) -> int:
        return self.view.recomputes_unobserved

    @property
    def recompute_steps(self) -> dict[str, tuple[int, int]]:
        return dict(self.view.recompute_steps)

    def params_of(self, module: str) -> tuple[str, ...]:
        """The parameters ZeRO-3 fetches for ``module``: its own, or all under it for a z3 leaf module."""
        return self.view.own.get(module, ())

    def deliver(self) -> None:
        self._sink.deliver()

    def emit(self, kind: EventKind, **fields: Any) -> None:
        self.core.emit(kind, **fields)

    # ------------------------------------------------------------ install
    def install(self) -> WatchTracer:
        core, view = self.core, self.view
        core.install(view)
        self._report_gathered()
        eng = self.engine
        core.patch(eng, "forward", self._w_forward)
        core.patch(eng, "backward", self._w_backward)
        core.patch(eng, "step", self._w_step)
        if core.coord is not None and hasattr(core.coord, _GATHER):
            core.patch(core.coord, _GATHER, self._w_all_gather)
            view.gather_seen = True
        off = compat.offload(core.opt) if self.stage == 3 else None
        if off is not None and hasattr(off, "_register_deepspeed_module"):
            core.patch(off, "_register_deepspeed_module", lambda f: self._w_register(f, off.module))
        for lname, m in self.leaves.items():
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs, n=lname: self._leaf_input(n, args, kwargs), with_kwargs=True))
        ACTIVE.append(self)
        install_observers()
        core.trace_synced = core.mode in (None, "INVALID")
        return self

    def _report_gathered(self) -> None:
        """An engine watched after it has run: the parameters DeepSpeed holds gathered now (persistent ones after a
        step) are reported as fetched / prefetched with their holders, so the specs start from DeepSpeed's state
        (the core's `resync` takes it as already reported; ``available-when-used`` would then see a module compute
        with parameters it never saw fetched)."""
        core = self.core
        if self.stage != 3:
            return
        for n, _ in core.params:
            st = core.emitted.get(n)
            if st == "AVAILABLE":  # note: not an all-gather of this run (the memory figures skip it)
                core.emit(EventKind.FETCH, param=n, note=WATCH_START)
            elif st == "INFLIGHT":
                core.emit(EventKind.PREFETCH, param=n, module=n.rsplit(".", 1)[0], note=WATCH_START)
            if core.holders.get(n, 0):
                core.emit(EventKind.HOLDERS, param=n, value=core.holders[n], note="+")

    def uninstall(self) -> None:
        if self in ACTIVE:
            ACTIVE.remove(self)
        if not ACTIVE:
            uninstall_observers()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.core.uninstall()

    def _leaf_input(self, name: str, args: tuple, kwargs: dict) -> None:
        ts = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.leaf_inputs[name] = any(t.requires_grad for t in ts)

    # ------------------------------------------------------------ torch's checkpoint (torch_observers)
    def on_checkpoint(self, kind: EventKind, param: str, note: str | None = None) -> None:
        """A frozen parameter saved live by a recompute (SAVE_LIVE), checked by torch (UNPACK ``check``) or read by
        the backward (UNPACK ``use``)."""
        if self.stage != 3:
            return
        module = param.rsplit(".", 1)[0]
        self.view.poll_module(module, (param,))
        self.core.emit(kind, param=param, module=module, note=note)

    def on_recompute(self, fn: Callable[..., Any], start: bool) -> None:
        if self.stage != 3 or torch._C._current_graph_task_id() == -1:
            return
        view = self.view
        name = self.mod_names.get(id(checkpointed_module(fn)), "checkpoint")
        if start:
            self.core.task()
            view.recomputes_observed += 1
            view.saw_recompute("non-reentrant")
            view.recompute_depth += 1
            self.core.emit(EventKind.RECOMPUTE_START, module=name)
        else:
            view.poll_module(None)
            view.recompute_depth = max(0, view.recompute_depth - 1)
            self.core.emit(EventKind.RECOMPUTE_END, module=name)

    # ------------------------------------------------------------ the loop, from the engine's calls
    def mark(self, what: str, poll_trace: bool = True, **info: Any) -> None:
        if what == "backward_start":
            self.view.bwd_pre.clear()
            self.view.bwd_post.clear()
        elif what == "backward_end":
            self.backward_leftovers = self.view.leftovers()
        self.core.mark(what, poll_trace, **info)

    def _w_forward(self, f: Wrapper) -> Wrapper:
        def forward(*a: Any, **k: Any) -> Any:
            ev = not torch.is_grad_enabled() or not self.core.module.training
            self.mark("eval_start" if ev else "forward_start")
            self.engine_calls += 1
            try:
                r = f(*a, **k)
            finally:
                self.engine_calls -= 1
            self.mark("eval_end" if ev else "forward_end")
            return r
        return forward

    def _root_forward(self, module: torch.nn.Module, start: bool) -> None:
        """The root module called outside ``engine.forward`` (DPO's reference pass, ``engine.module(x)``): DeepSpeed's
        own root pre-forward hook (``_start_of_forward_hook``) has just reset the coordinator's step, as at any root
        forward, so it is one -- FORWARD_START (or EVAL_FORWARD_START) before that trace-mode change is reported."""
        if start:
            if self.engine_calls:
                return
            ev = not torch.is_grad_enabled() or not module.training
            self._direct.append("eval_end" if ev else "forward_end")
            self.engine_calls += 1
            self.mark("eval_start" if ev else "forward_start", poll_trace=False)
        elif self._direct and self.engine_calls == 1:
            self.engine_calls -= 1
            self.mark(self._direct.pop())

    def _w_backward(self, f: Wrapper) -> Wrapper:
        def backward(*a: Any, **k: Any) -> Any:
            self.backwards += 1
            self.mark("backward_start", kind="engine")
            self.engine_calls += 1
            try:
                r = f(*a, **k)
            finally:
                self.engine_calls -= 1
            self.mark("backward_end", kind="engine")
            return r
        return backward

    def _w_step(self, f: Wrapper) -> Wrapper:
        def step(*a: Any, **k: Any) -> Any:
            boundary = self.engine.is_gradient_accumulation_boundary()
            if boundary:
                self.mark("step", step=self.steps)
            r = f(*a, **k)
            if boundary:
                self.steps += 1
                self.view.step = self.steps
            return r
        return step

    def _w_register(self, f: Wrapper, root: torch.nn.Module) -> Wrapper:
        """Hooks registered again on the root module after the engine was built (TRL's
        ``unwrap_model_for_generation`` at ZeRO-3: ``remove_hooks``, generate, ``add_hooks``, which invalidates the
        coordinator's trace and calls ``_register_deepspeed_module``): REREGISTER, which calls for the INVALID trace
        that follows, as the explorer's re-registration reports it."""
        def register(module: torch.nn.Module, *a: Any, **k: Any) -> Any:
            if module is not root:  # its own recursion over the children
                return f(module, *a, **k)
            self.core.emit(EventKind.REREGISTER)  # before any poll: the caller may have invalidated the trace already
            r = f(module, *a, **k)
            self.core.poll()
            return r
        return register

    def _w_all_gather(self, f: Wrapper) -> Wrapper:
        names, dirty = self.param_names, self.view.dirty

        def all_gather(params: Any, *a: Any, **k: Any) -> Any:
            dirty.update(names[id(p)] for p in params if id(p) in names)
            return f(params, *a, **k)
        return all_gather

    # ------------------------------------------------------------ PyTorch-style backward (loss.backward())
    def plain_backward_start(self, kind: str) -> None:
        """A PyTorch-style backward (``torch`` / ``nonscalar``) began outside the engine's calls: its window opens
        at the first graph task that reaches this engine (the core's task hook), only for the engines it reaches."""
        self._plain = kind
        self.core.task_hook = self._open_plain

    def _open_plain(self) -> None:
        if self._plain is None or torch._C._current_graph_task_id() == -1:
            return
        kind, self._plain = self._plain, None
        self.core.task_hook = None
        self._plain_open = kind
        self.backwards += 1
        self.mark("backward_start", kind=kind)

    def plain_backward_end(self) -> None:
        self._plain = None
        self.core.task_hook = None
        if self._plain_open is not None:
            kind, self._plain_open = self._plain_open, None
            self.mark("backward_end", kind=kind)


__all__ = ["BATCH", "QueueSink", "UserModelView", "WATCH_START", "WatchTracer", "z3_leaf_modules"]
