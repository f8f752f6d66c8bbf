"""The tracer core: DeepSpeed's hook lifecycle observed on one engine and emitted as zerostate events.

`TraceCore.install()` rebinds, on *instances* (the engine, its ZeRO optimizer, the hook-state manager, the
ZeRO-3 offload object and parameter coordinator) and in two modules (``count_used_parameters_in_backward`` as
imported by stage3 and stage_1_and_2), a thin wrapper around each observed function; `TraceCore.uninstall()`
puts every original back.  Release differences come from `compat`.  Two tracers compose it:

* the harness's `zerostate.tracing.harness_tracer.Tracer` (zerostate's own network, a scenario's names), and
* the watch's `zerostate.watcher.tracer.WatchTracer` (any model, the user's names),

each with a `Sink` (where events go: a list of dicts for the worker, a queue of shared `Event` s for the watch)
and a `ModelView` (what the model's names mean: the module hooks to report, z3 leaf modules).

=====================================  ==============================================================
observed                               events (`EventKind`)
=====================================  ==============================================================
training loop marks (`mark`)           FORWARD_START/END, EVAL_FORWARD_START/END, USER_BACKWARD_START/END
                                       (note = backward kind), STEP (value = train step), REREGISTER
first sight of a graph task            TASK_START (note outer / nested / pre; task ids renumbered 0, 1, ..
                                       by first sight); TASK_END from a callback queued on that task
engine._backward_prologue              OUTPUT_HOOK
hook-state enter/exit_backward         ENTER_BACKWARD / EXIT_BACKWARD (value = depth after)
queue_post_backward_callback           CALLBACK_QUEUED (when it newly queued)
run_grad_acc_post_hooks                CALLBACK_RUN (when called from the queued callback), POST_HOOKS
engine._backward_epilogue              BUCKET_FLUSH (gradients handled since the last flush), EPILOGUE
gradient sink (reduce / process)       GRAD_HOOK or LEAF_HOOK (by the calling hook closure), BUCKET_ADD
count_used_parameters_in_backward      COUNT (task, value = its result)
hook state's update after a count      EXPECTED (task, value = the expected count it is handed)
stage3 _pre_step                       BUCKET_CLEAR (value = stale params found in the real ipg buckets)
ZeRO-3 offload pre/post fwd/bwd        the view's module events (MODULE_PRE/POST_FORWARD / BACKWARD ...)
parameter ds_status / holders / mode   FETCH (note ``inflight``: waited on a prefetch) / PREFETCH /
                                       RELEASE / HOLDERS / PERSISTENT / TRACE_STATE, polled after every
                                       coordinator call, epilogue, step and loop mark
=====================================  ==============================================================
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
from typing import Any, Protocol
from collections.abc import Callable, Iterator

import torch

from zerostate.model.events import EventKind
from zerostate.runtime.patcher import Patcher

from zerostate.tracing import compat, marks

_THIS_FILE = sys._getframe().f_code.co_filename
"""This module's code's file name, as its frames carry it (``__file__`` is not defined where a repro script embeds
the module)."""
_GRAD_SINKS = (compat.grad_sink(3), compat.grad_sink(1))
"""What the ZeRO-3 and ZeRO-1/2 optimizers' gradient hooks call (`compat.grad_sink`): an object with one is an
optimizer whose hooks may count."""
ROOT = "model"
"""The root module's name in events (torch names it ``""``), as in ``zerostate.model.network``."""
_TRACE_MODE = "_PartitionedParameterCoordinator__trace_mode"
"""partitioned_param_coordinator.py ``self.__trace_mode`` (a ``ZeRoTraceMode``), what ``is_record_trace()`` /
``is_complete_trace()`` compare (0.18.4-0.19.8): `TraceCore.poll_trace` reads it once per poll instead of calling
both."""

Wrapper = Callable[..., Any]
MODULE_HOOK_KINDS = {"pre_forward": EventKind.MODULE_PRE_FORWARD, "post_forward": EventKind.MODULE_POST_FORWARD,
                     "pre_backward": EventKind.MODULE_PRE_BACKWARD, "post_backward": EventKind.MODULE_POST_BACKWARD}
"""The offload object's four module hooks (``<what>_function``) and the event each is."""


class Sink(Protocol):
    """Where a tracer's events go, in order."""

    def put(self, kind: EventKind, param: str | None, module: str | None, task: int | None, value: Any,
            phase: str | None, note: str | None) -> None: ...


class ModelView(Protocol):
    """What a model's names mean to the tracer."""

    leaf_count: int
    """ZeRO-3 leaf modules with a trainable parameter (each fires one hook: added to COUNT's value)."""

    def leaf_module_of(self, param: str) -> str:
        """The z3 leaf module whose backward hook handles ``param``."""
        ...

    def module_hook(self, what: str, f: Wrapper) -> Wrapper:
        """The wrapper of the offload object's ``<what>_function`` (``pre_forward``, ``post_forward``, ...)."""
        ...


class TraceCore:
    """One engine's DeepSpeed hooks, observed.  ``sink`` receives the events; ``view`` (set by `install`) names the
    model's modules."""

    def __init__(self, engine: Any, stage: int, sink: Sink) -> None:
        self.engine = engine
        self.opt = engine.optimizer
        self.stage = stage
        self._put = sink.put
        self.view: ModelView | None = None
        self.lock = threading.RLock()
        self.patcher = Patcher()
        self.tasks: dict[int, int] = {}
        """torch graph task id -> its small id (first sight order)."""
        self._stack: list[int] = []
        self._pending: list[int] = []
        self.in_pre = False
        """Inside a backward made during the forward (a fused loss; `marks.PRE_BACKWARD_OBSERVER`)."""
        self.eval = False
        self.paused_depth = 0
        self._bucket: set[str] = set()
        self._leaf_frame: Any = None
        self._nest = 0
        self.module = engine.module
        self.param_names: dict[int, str] = {id(p): n for n, p in self.module.named_parameters()}
        self.params: list[tuple[str, torch.nn.Parameter]] = list(self.module.named_parameters())
        self._frozen: dict[str, bool] = {}
        """Each parameter's ``requires_grad`` off as last declared (ROLE)."""
        self._leaves_declared = False
        self._unobserved_declared = False
        self.mod_names: dict[int, str] = {id(m): (n or ROOT) for n, m in self.module.named_modules()}
        self.coord = compat.coordinator(self.opt) if stage == 3 else None
        self.emitted: dict[str, str] = {}
        """Parameter -> the status last reported (AVAILABLE / INFLIGHT / NOT_AVAILABLE)."""
        self.holders: dict[str, int] = {}
        self.mode: str | None = None
        """The trace mode last seen."""
        self._mode_raw: Any = None
        self._raw_trace = self.coord is not None and hasattr(self.coord, _TRACE_MODE)
        self.trace_synced = True
        """The trace mode is reported (TRACE_STATE): from the start, or for an engine watched after its trace was
        recorded, from DeepSpeed's next invalidation (`poll_trace`)."""
        self.on_trace_sync: Callable[[], None] | None = None
        self.task_hook: Callable[[], None] | None = None
        """Called at every graph-task lookup while set (the watch opens a PyTorch-style backward's window there)."""
        self._declared = False
        self._counted: tuple[int | None, int] | None = None
        """A COUNT emitted whose EXPECTED is still to come: ``(task, count + leaf modules)``."""
        self.installed = False
        """Between `install` and `uninstall`: a wrapper still called after (one left inside another engine's
        wrapper of a module function) passes the call through."""
        self._state_expects = False
        """The hook state takes the expected count (``update_hook_state_and_maybe_run_epilogue``, 0.18.5+)."""

    # ------------------------------------------------------------ emitting
    def emit(self, kind: EventKind, param: str | None = None, module: str | None = None, task: int | None = None,
             value: Any = None, phase: str | None = None, note: str | None = None) -> None:
        if self.paused_depth:
            return
        self._put(kind, param, module, task, value, phase, note)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is emitted inside; DeepSpeed's state after it is taken as already reported."""
        self.poll()  # report what happened before the pause (e.g. engine.step()'s persistent re-gather)
        self.paused_depth += 1
        try:
            yield
        finally:
            self.paused_depth -= 1
            self.resync()

    def task(self) -> int | None:
        """The small id of the running graph task (None outside a backward); TASK_START at its first sight."""
        if self.task_hook is not None:
            self.task_hook()
        tid = torch._C._current_graph_task_id()
        if tid == -1:
            return None
        small = self.tasks.get(tid)
        if small is None:
            small = len(self.tasks)
            self.tasks[tid] = small
            if self.in_pre:
                note, parent = "pre", None
            elif self._stack:
                note, parent = "nested", self._stack[-1]
            else:
                note, parent = "outer", None
            self.emit(EventKind.TASK_START, task=small, value=parent, note=note)
            self._stack.append(small)
            self._pending.append(small)
        return small

    def flush(self) -> None:
        """Queue TASK_END callbacks for newly seen tasks, after DeepSpeed's own callback."""
        if self._nest or not self._pending or torch._C._current_graph_task_id() == -1:
            return
        eng = torch.autograd.Variable._execution_engine
        cur = self.tasks.get(torch._C._current_graph_task_id())
        for small in list(self._pending):
            if small == cur:
                eng.queue_callback(functools.partial(self._task_end, small))
                self._pending.remove(small)

    def _task_end(self, small: int) -> None:
        self.emit(EventKind.TASK_END, task=small)
        if small in self._stack:
            self._stack.remove(small)

    # ------------------------------------------------------------ statuses
    def resync(self) -> None:
        """Take DeepSpeed's current parameter state as already reported (after a paused section)."""
        if self.stage != 3:
            return
        for n, p in self.params:
            st = compat.param_status(p)
            self.emitted[n] = st if st in ("AVAILABLE", "INFLIGHT") else "NOT_AVAILABLE"
            self.holders[n] = compat.holders(p)
        self.mode = compat.trace_mode(self.coord)
        self._mode_raw = None  # `mode` was set from DeepSpeed: the next poll compares again

    def poll(self, module: str | None = None, trace: bool = True) -> None:
        """Report status and holder changes of every parameter since the last poll (``module``: the hooked module
        whose fetch / release just ran); ``trace``: and the trace mode's."""
        if self.stage != 3 or self.paused_depth:
            return
        self.scan(self.params, module, trace)

    def scan(self, items: list[tuple[str, Any]] | tuple[tuple[str, Any], ...], module: str | None,
             trace: bool = True) -> None:
        """Report the status and holder changes of ``items``.  A parameter that became gathered is a PREFETCH while
        its all-gather is in flight (``ds_status`` INFLIGHT), else a FETCH for the hooked module (also one another
        module owns: an external parameter, peft's ``lora_A`` read in ``Linear.forward``)."""
        status, emitted, hold, emit = compat.param_status, self.emitted, self.holders, self.emit
        for n, p in items:
            # compat.param_status / compat.holders, inlined (this loop runs per parameter, per module hook):
            # ZeroParamStatus's member name read as the plain attribute ``_name_`` (``.name`` is a property)
            st = getattr(p, "ds_status", None)
            new = "AVAILABLE" if st is None else (getattr(st, "_name_", None) or status(p))
            em = emitted.get(n)
            h_old, h_new = hold.get(n, 0), len(getattr(p, "ds_active_sub_modules", None) or ())
            if h_old == h_new and new == em:
                continue
            if h_new < h_old:
                hold[n] = h_new
                emit(EventKind.HOLDERS, param=n, module=module, value=h_new, note="-")
            if new == "NOT_AVAILABLE" and em != "NOT_AVAILABLE":
                emit(EventKind.RELEASE, param=n, module=n.rsplit(".", 1)[0])
            elif new == "INFLIGHT" and em in (None, "NOT_AVAILABLE"):
                emit(EventKind.PREFETCH, param=n, module=n.rsplit(".", 1)[0])
            elif new == "AVAILABLE" and em in (None, "NOT_AVAILABLE"):
                emit(EventKind.FETCH, param=n, module=module)
            elif new == "AVAILABLE" and em == "INFLIGHT":
                emit(EventKind.FETCH, param=n, module=module, note="inflight")
            emitted[n] = new
            if h_new > h_old:
                hold[n] = h_new
                emit(EventKind.HOLDERS, param=n, module=module, value=h_new, note="+")
        if trace:
            self.poll_trace()

    def trace_changed(self) -> bool:
        """The coordinator's trace mode may have changed since the last poll (one attribute read)."""
        if not self._raw_trace:
            return self.coord is not None
        return getattr(self.coord, _TRACE_MODE) is not self._mode_raw

    def poll_trace(self) -> None:
        """TRACE_STATE when the coordinator's trace mode changed.  An engine watched after DeepSpeed recorded its
        module trace (``trace_synced`` False): the recorded order is unknown, so the mode is reported only from
        DeepSpeed's next invalidation on (``on_trace_sync`` then)."""
        if self.stage != 3 or self.paused_depth:
            return
        if self._raw_trace:
            raw = getattr(self.coord, _TRACE_MODE)
            if raw is self._mode_raw:  # unchanged since the last poll (the usual case)
                return
            self._mode_raw = raw
            name = raw.name
            mode = name if name in ("RECORD", "COMPLETE") else "INVALID"  # as compat.trace_mode
        else:
            mode = compat.trace_mode(self.coord)
        if mode != self.mode:
            self.mode = mode
            if self.trace_synced:
                self.emit(EventKind.TRACE_STATE, note=mode)
            elif mode == "INVALID":
                self.trace_synced = True
                if self.on_trace_sync is not None:
                    self.on_trace_sync()

    # ------------------------------------------------------------ patching
    def patch(self, obj: Any, attr: str, make: Callable[[Wrapper], Wrapper], shared: bool = False) -> None:
        """Wrap ``obj.attr`` with ``make(original)``; events emitted inside are flushed when the outermost
        wrapped call returns.  Nothing happens when ``obj`` is None or lacks ``attr`` (another release).

        ``shared``: ``obj`` is a module every engine's tracer wraps (another engine of the process may wrap it
        after this one): at uninstall the original goes back only while this wrapper is still the outermost, and
        a wrapper left inside another's is a plain call from then on."""
        def wrapper(orig: Wrapper) -> Wrapper:
            inner = make(orig)

            def outer(*a: Any, **k: Any) -> Any:
                if not self.installed:
                    return orig(*a, **k)
                self._nest += 1
                try:
                    return inner(*a, **k)
                finally:
                    self._nest -= 1
                    if not self._nest:
                        self.flush()
            outer.__wrapped__ = orig  # type: ignore[attr-defined]
            return outer
        self.patcher.wrap(obj, attr, wrapper, guard=shared)

    def uninstall(self) -> None:
        self.installed = False
        self.patcher.undo()
        self._leaf_frame = None
        marks.PRE_BACKWARD_OBSERVER = None

    def install(self, view: ModelView) -> None:
        """Wrap DeepSpeed's hook lifecycle of this engine; ``view`` names the model's modules."""
        self.view = view
        self.installed = True
        marks.PRE_BACKWARD_OBSERVER = (self._pre_start, self._pre_end)
        eng, opt = self.engine, self.opt
        if self.stage == 0:  # no ZeRO optimizer and no hook manager: the loop's marks only
            self.resync()
            return
        self.patch(eng, "_backward_prologue", self._w_prologue)
        self.patch(eng, "_backward_epilogue", self._w_epilogue)
        owner = compat.hook_state_owner(opt)
        self.patch(owner, "enter_backward", lambda f: self._w_depth(f, EventKind.ENTER_BACKWARD))
        self.patch(owner, "exit_backward", lambda f: self._w_depth(f, EventKind.EXIT_BACKWARD))
        self.patch(owner, "run_grad_acc_post_hooks", self._w_post_hooks)
        self.patch(owner, "queue_post_backward_callback", self._w_queue)
        self._state_expects = hasattr(owner, "update_hook_state_and_maybe_run_epilogue")
        self.patch(owner, "update_hook_state_and_maybe_run_epilogue", self._w_expected)
        self.patch(opt, compat.grad_sink(self.stage), self._w_sink)
        for modname in compat.COUNT_MODULES:
            self.patch(importlib.import_module(modname), compat.COUNT_NAME, self._w_count, shared=True)
        if self.stage == 3:
            self.patch(opt, "_pre_step", self._w_pre_step)
            # engine.step() partitions every parameter, then re-gathers the persistent ones: poll after each
            self.patch(opt, "_partition_all_parameters", self._w_polled)
            self.patch(opt, "_post_step", self._w_polled)
            off = compat.offload(opt)
            for what in MODULE_HOOK_KINDS:  # pre_sub_module_forward_function, ...
                when, call = what.split("_")
                self.patch(off, f"{when}_sub_module_{call}_function", functools.partial(_module_hook, view, what))
        self.resync()

    # ------------------------------------------------------------ loop marks
    def mark(self, what: str, poll_trace: bool = True, **info: Any) -> None:
        """A mark of the training loop (``forward_start``, ``backward_end``, ``step``, ...: `marks.LOOP_MARKS`).
        ``poll_trace``: report a trace-mode change before the mark (False: the change belongs after it)."""
        self.poll(trace=poll_trace)
        kind = marks.LOOP_MARKS.get(what)
        if kind is not None:
            if kind in (EventKind.EVAL_FORWARD_START, EventKind.EVAL_FORWARD_END):
                self.eval = kind is EventKind.EVAL_FORWARD_START
            note = info.get("kind") if kind in (EventKind.USER_BACKWARD_START, EventKind.USER_BACKWARD_END) else None
            self.emit(kind, value=info.get("step") if kind is EventKind.STEP else None, note=note)
            if kind in (EventKind.FORWARD_START, EventKind.EVAL_FORWARD_START):
                self._declare_persistent()
                self._declare_roles()
                if self.stage == 0 and not self._unobserved_declared:  # `install` wraps no gradient sink there
                    self._unobserved_declared = True
                    self.emit(EventKind.GRADIENTS_UNOBSERVED)
        elif what in ("gather_start", "gather_end"):  # the loop's own GatheredParameters (its statuses polled above)
            self.emit(EventKind.USER_GATHER, note="enter" if what == "gather_start" else "exit")
        elif what == "resume_start":  # the engine is saved and destroyed: nothing of it is traced from here
            self.paused_depth += 1
        elif what == "save_load_start":  # a checkpoint round trip: no hook runs in it; ZeRO-3's gathers (16-bit
            self.paused_depth += 1  # state dict, checkpoint prologue / epilogue) are not traced
        elif what == "save_load_end":
            self.paused_depth -= 1
            self.poll()  # what it changed for good is reported (a parameter it released, at ZeRO-3)

    def _declare_roles(self) -> None:
        """A ROLE for each parameter whose role changed since the last forward (frozen, trainable again, a z3 leaf
        module's): what a finding's fingerprint says of the parameters involved, the same in explore and watch."""
        if not self._leaves_declared:
            self._leaves_declared = True
            for m_name, m in self.module.named_modules():
                if getattr(m, "_z3_leaf", False):
                    for p_name, _ in m.named_parameters():
                        self.emit(EventKind.ROLE, param=f"{m_name}.{p_name}" if m_name else p_name, note="leaf")
        for n, p in self.params:
            frozen = not p.requires_grad
            if frozen != self._frozen.get(n, False):
                self._frozen[n] = frozen
                self.emit(EventKind.ROLE, param=n, note="frozen" if frozen else "trainable")

    def _declare_persistent(self) -> None:
        if self.stage == 3 and not self._declared:
            self._declared = True
            for n, p in self.params:
                if compat.is_persistent(p):
                    self.emit(EventKind.PERSISTENT, param=n)

    def _pre_start(self) -> None:
        self.in_pre = True

    def _pre_end(self) -> None:
        self.in_pre = False

    # ------------------------------------------------------------ wrappers
    def _w_prologue(self, f: Wrapper) -> Wrapper:
        def prologue(*a: Any, **k: Any) -> Any:
            self.emit(EventKind.OUTPUT_HOOK, task=self.task())
            r = f(*a, **k)
            self.flush()
            return r
        return prologue

    def _w_epilogue(self, f: Wrapper) -> Wrapper:
        def epilogue(*a: Any, **k: Any) -> Any:
            task = self.task()
            self.emit(EventKind.BUCKET_FLUSH, value=len(self._bucket))
            self._bucket.clear()
            self.emit(EventKind.EPILOGUE, task=task)
            r = f(*a, **k)
            self.poll()
            self.flush()
            return r
        return epilogue

    def _w_depth(self, f: Wrapper, kind: EventKind) -> Wrapper:
        def wrapped(*a: Any, **k: Any) -> Any:
            self.task()
            r = f(*a, **k)
            self.emit(kind, value=compat.depth(self.opt))
            self.flush()
            return r
        return wrapped

    def _w_post_hooks(self, f: Wrapper) -> Wrapper:
        def post_hooks(*a: Any, **k: Any) -> Any:
            task = self.task()
            if sys._getframe(2).f_code.co_name in compat.CALLBACK_FRAMES:
                self.emit(EventKind.CALLBACK_RUN, task=task)
            if compat.depth(self.opt) == 0:
                note = "skipped: no active backward"
            elif getattr(self.engine, "_running_engine_backward", False):
                note = "deferred to engine.backward"
            else:
                note = "ran epilogue"
            self.emit(EventKind.POST_HOOKS, note=note)
            r = f(*a, **k)
            self.flush()
            return r
        return post_hooks

    def _w_queue(self, f: Wrapper) -> Wrapper:
        def queue(*a: Any, **k: Any) -> Any:
            task = self.task()
            before = compat.callback_queued(compat.hook_state_owner(self.opt))
            r = f(*a, **k)
            if r and not before:
                self.emit(EventKind.CALLBACK_QUEUED, task=task)
            self.flush()
            return r
        return queue

    def _w_sink(self, f: Wrapper) -> Wrapper:
        def sink(param: Any, *a: Any, **k: Any) -> Any:
            task = self.task()
            name = self.param_names.get(id(param), "?")
            frame = sys._getframe(2)
            if frame.f_code.co_name in compat.LEAF_HOOK_FRAMES:
                if frame is not self._leaf_frame:
                    self._leaf_frame = frame
                    self.emit(EventKind.LEAF_HOOK, module=self.view.leaf_module_of(name), task=task)  # type: ignore[union-attr]
            else:
                self.emit(EventKind.GRAD_HOOK, param=name, task=task)
            self.emit(EventKind.BUCKET_ADD, param=name)
            self._bucket.add(name)
            r = f(param, *a, **k)
            self.flush()
            return r
        return sink

    def _w_count(self, f: Wrapper) -> Wrapper:
        """Every engine of the process calls the one module function: a call over another engine's parameters is
        that engine's (its own tracer reports it), not this one's."""
        def count(*a: Any, **k: Any) -> Any:
            if not self._own_count(a[0] if a else next(iter(k.values()), ())):
                return f(*a, **k)
            task = self.task()
            v = f(*a, **k)
            self.emit(EventKind.COUNT, task=task, value=int(v))
            expected = int(v) + self.view.leaf_count  # type: ignore[union-attr]
            if self._state_expects:  # DeepSpeed's own sum comes with the hook state's update (`_w_expected`)
                self._counted = (task, expected)
            else:  # before 0.18.5 the sum is the remaining-hooks counter itself: the leaf modules as configured
                self.emit(EventKind.EXPECTED, task=task, value=expected)
            self.flush()
            return v
        return count

    def _own_count(self, params: Any) -> bool:
        """Whether this engine's gradient hook made the call: the optimizer its closure holds (``self`` in DeepSpeed's,
        ``opt`` in the runtime's), found a few frames up past the tracers' own wrappers; when none is found, whether
        the parameters counted are this engine's.  Two engines over one module count the same parameters, each from
        its own hooks."""
        frame: Any = sys._getframe(2)
        seen = 0
        while frame is not None and seen < 4:
            if frame.f_code.co_filename != _THIS_FILE:
                seen += 1
                local = frame.f_locals
                for name in ("self", "opt"):
                    holder = local.get(name)
                    if holder is self.opt:
                        return True
                    if any(hasattr(holder, m) for m in _GRAD_SINKS):  # another engine's ZeRO optimizer
                        return False
            frame = frame.f_back
        return not params or any(id(p) in self.param_names for p in params)

    def _w_expected(self, f: Wrapper) -> Wrapper:
        """The count the hook state is handed right after a COUNT is DeepSpeed's expectation for the phase (the
        count plus its z3 leaf modules, as the hook computed it); later hooks hand it the maximum seen."""
        def update(*a: Any, **k: Any) -> Any:
            counted, self._counted = self._counted, None
            if counted is not None:
                given = a[0] if a else next(iter(k.values()), counted[1])
                self.emit(EventKind.EXPECTED, task=counted[0], value=int(given))
            return f(*a, **k)
        return update

    def _w_pre_step(self, f: Wrapper) -> Wrapper:
        def pre_step(*a: Any, **k: Any) -> Any:
            stale = compat.stale_bucket_count(self.opt)
            r = f(*a, **k)
            if stale and compat.stale_bucket_count(self.opt) < stale:
                self.emit(EventKind.BUCKET_CLEAR, value=stale)
                self._bucket.clear()
            self.poll()
            return r
        return pre_step

    def _w_polled(self, f: Wrapper) -> Wrapper:
        def polled(*a: Any, **k: Any) -> Any:
            r = f(*a, **k)
            self.poll()
            return r
        return polled


def _module_hook(view: ModelView, what: str, f: Wrapper) -> Wrapper:
    return view.module_hook(what, f)


__all__ = ["MODULE_HOOK_KINDS", "ModelView", "ROOT", "Sink", "TraceCore"]
