"""The tracer for a user's own model: `Tracer` with the user's module names and torch's checkpoint observed.

`Tracer` was written for zerostate's own network (``blocks.<i>.norm`` / ``.lin`` / ``head``, and a
checkpoint wrapper that reports its recomputes).  A user's model has other names and calls
``torch.utils.checkpoint`` itself (Hugging Face ``gradient_checkpointing_enable``), so `WatchTracer`:

* reports the module hooks of *every* module DeepSpeed hooks, under the user's names (the root as
  ``model``), with the phase (forward / recompute / eval) as `Tracer` does;
* names a z3 leaf module's gradient hook by the leaf module that owns the parameter;
* marks the training loop from the engine's own calls: ``engine.forward`` (FORWARD_START/END, or
  EVAL_FORWARD_* under ``no_grad`` / ``eval()``), ``engine.backward`` (USER_BACKWARD_START/END, kind
  ``engine``), ``engine.step`` at the accumulation boundary (STEP);
* observes ``torch.utils.checkpoint``'s non-reentrant machinery (torch/utils/checkpoint.py):
  the recompute (RECOMPUTE_START/END around ``_run_fn_with_dynamo_disabled(frame.recompute_fn)``),
  every ZeRO-3 parameter the recompute saves *live* (``_recomputation_hook``'s pack hook keeps
  ``x`` itself when ``not x.requires_grad``: SAVE_LIVE), torch's metadata check of the recomputed
  tensors (``_CheckpointFrame.check_recomputed_tensors_match``: UNPACK note=check) and the
  backward's read of a saved parameter (``_checkpoint_hook``'s unpack hook: UNPACK note=use).
  This is what seed 002 (DeepSpeed 0.19.2, fixed in 0.19.3 by deepspeedai/DeepSpeed#8130/#8148) breaks:
  a frozen parameter saved live is partitioned in place before torch checks it.

The checkpoint patches are process-wide (module / class attributes of torch.utils.checkpoint),
installed with the first `WatchTracer` and removed with the last; each event goes to the tracer
whose engine owns the parameter.
"""

from __future__ import annotations

import collections
import functools
import threading

import torch
import torch.utils.checkpoint as _ckpt

from zerostate.model.events import EventKind, Event

from zerostate.tracing import compat
from zerostate.tracing.tracer import ROOT, Tracer

_TRACE_MODE = "_PartitionedParameterCoordinator__trace_mode"
"""partitioned_param_coordinator.py ``self.__trace_mode`` (a ``ZeRoTraceMode``), what ``is_record_trace()`` /
``is_complete_trace()`` compare (0.18.4-0.19.8): `WatchTracer._poll_trace` reads it once per module hook instead
of calling both."""
_GATHER = "_PartitionedParameterCoordinator__all_gather_params"
"""partitioned_param_coordinator.py ``__all_gather_params(params, forward)`` (0.18.4-0.19.8): every fetch and
prefetch all-gathers through it."""
_ACTIVE: list["WatchTracer"] = []
_EVENTS: dict[tuple, Event] = {}
"""(kind, param, module, task, value, phase, note) -> the one `Event` with those fields."""
_EVENTS_MAX = 200_000
BATCH = 256
"""Events a tracer holds before it hands them to its sink (`WatchTracer.deliver`)."""
WATCH_START = "watch-start"
"""The note of the FETCH / PREFETCH events that report what was gathered when watching began."""
_CKPT_LOCK = threading.Lock()
_CKPT_ORIG: dict[str, object] = {}
_BWD_ORIG: dict[str, object] = {}


def _owner(t) -> tuple["WatchTracer", str] | None:
    for tr in _ACTIVE:
        n = tr.param_names.get(id(t))
        if n is not None:
            return tr, n
    return None


def _saved_frozen(t):
    """The (tracer, name) of ``t`` when it is a frozen ZeRO parameter a checkpoint keeps as itself."""
    if not isinstance(t, torch.Tensor) or t.requires_grad:
        return None
    return _owner(t)


def _install_checkpoint_observer() -> None:
    """Patch torch.utils.checkpoint once (the names are looked up at call time inside the module)."""
    with _CKPT_LOCK:
        if _CKPT_ORIG:
            return
        needed = ("_recomputation_hook", "_checkpoint_hook", "_CheckpointFrame", "_run_fn_with_dynamo_disabled")
        if not all(hasattr(_ckpt, n) for n in needed):  # another torch: hooks and coordinator still watched
            return
        rec_cls, hook_cls = _ckpt._recomputation_hook, _ckpt._checkpoint_hook
        run_fn, check = _ckpt._run_fn_with_dynamo_disabled, _ckpt._CheckpointFrame.check_recomputed_tensors_match

        class _WatchedRecomputation(rec_cls):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                inner = self.pack_hook

                @functools.wraps(inner)  # __wrapped__: the runtime's release policy recognises torch's pack hook
                def pack_hook(x):
                    hit = _saved_frozen(x)
                    if hit is not None:
                        tr, n = hit
                        tr.on_checkpoint("save_live", n)
                    return inner(x)
                self.pack_hook = pack_hook

        class _WatchedCheckpoint(hook_cls):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                inner = self.unpack_hook

                @functools.wraps(inner)
                def unpack_hook(holder):
                    ret = inner(holder)
                    hit = _saved_frozen(ret)
                    if hit is not None:
                        tr, n = hit
                        tr.on_checkpoint("use", n)
                    return ret
                self.unpack_hook = unpack_hook

        def run_watched(fn, *a, **k):
            trs = list(_ACTIVE)
            for tr in trs:
                tr.on_recompute(fn, True)
            try:
                return run_fn(fn, *a, **k)
            finally:
                for tr in trs:
                    tr.on_recompute(fn, False)

        def check_watched(frame, gid):
            for t in list(frame.recomputed[gid].values()):
                hit = _saved_frozen(t)
                if hit is not None:
                    tr, n = hit
                    tr.on_checkpoint("check", n)
            return check(frame, gid)

        _CKPT_ORIG.update(_recomputation_hook=rec_cls, _checkpoint_hook=hook_cls, _run_fn_with_dynamo_disabled=run_fn,
                          check=check)
        _ckpt._recomputation_hook = _WatchedRecomputation
        _ckpt._checkpoint_hook = _WatchedCheckpoint
        _ckpt._run_fn_with_dynamo_disabled = run_watched
        _ckpt._CheckpointFrame.check_recomputed_tensors_match = check_watched


def _backward_kind(tensors, grad_tensors) -> str:
    t = tensors[0] if isinstance(tensors, (tuple, list)) and tensors else tensors
    scalar = isinstance(t, torch.Tensor) and t.numel() == 1
    return "torch" if scalar or grad_tensors is None else "nonscalar"


def _install_backward_observer() -> None:
    """Patch ``torch.autograd.backward`` (``Tensor.backward`` calls it) once: a backward the user starts
    outside any watched engine's forward or backward, and outside a running backward (a reentrant
    checkpoint's), is a PyTorch-style user backward (DeepSpeed >= 0.18 runs its epilogue from a post-backward
    callback).  Each engine it reaches opens its window at its first graph task (`WatchTracer._task`) and
    closes it when the call returns."""
    with _CKPT_LOCK:
        if "backward" in _BWD_ORIG:
            return
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(tensors, grad_tensors=None, *a, **k):
            trs = []
            if torch._C._current_graph_task_id() == -1 and not any(tr._engine_calls for tr in _ACTIVE):
                trs = list(_ACTIVE)
                kind = _backward_kind(tensors, grad_tensors)
                for tr in trs:
                    tr._plain = kind
            try:
                return original(tensors, grad_tensors, *a, **k)
            finally:
                for tr in trs:
                    tr._plain_backward_end()

        _BWD_ORIG["backward"] = original
        torch.autograd.backward = backward


def _uninstall_backward_observer() -> None:
    with _CKPT_LOCK:
        if "backward" in _BWD_ORIG:
            torch.autograd.backward = _BWD_ORIG.pop("backward")


def _uninstall_checkpoint_observer() -> None:
    with _CKPT_LOCK:
        if not _CKPT_ORIG:
            return
        for name in ("_recomputation_hook", "_checkpoint_hook", "_run_fn_with_dynamo_disabled"):
            setattr(_ckpt, name, _CKPT_ORIG[name])
        _ckpt._CheckpointFrame.check_recomputed_tensors_match = _CKPT_ORIG["check"]
        _CKPT_ORIG.clear()


def _checkpointed_module(fn):
    """The module a non-reentrant checkpoint recomputes: torch hands `_run_fn_with_dynamo_disabled` its
    ``recompute_fn`` closure over the user's ``fn`` (torch/utils/checkpoint.py
    ``_checkpoint_without_reentrant_generator``); HF's ``GradientCheckpointingLayer`` passes
    ``partial(super().__call__)``, bound to the layer.  None when it is not a module's call (a plain function:
    RECOMPUTE_START then names no region, and ``available-when-used`` exempts nothing in it)."""
    for _ in range(4):
        target = getattr(getattr(fn, "func", fn), "__self__", None)
        if isinstance(target, torch.nn.Module):
            return target
        if isinstance(fn, torch.nn.Module):
            return fn
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if code is None or not cells or "fn" not in code.co_freevars:
            return None
        try:
            fn = cells[code.co_freevars.index("fn")].cell_contents
        except ValueError:  # an empty cell
            return None
    return None


def z3_leaf_modules(module) -> dict[str, object]:
    """The z3 leaf modules of ``module`` (``deepspeed.utils.set_z3_leaf_modules`` sets ``_z3_leaf``)."""
    return {(n or ROOT): m for n, m in module.named_modules() if getattr(m, "_z3_leaf", False)}


class WatchTracer(Tracer):
    """`Tracer` for any model.  ``sink(queue)`` receives every event, in order: `emit` queues the event (a
    ``deque``; the sink takes events from its left until it is empty) and `deliver` hands over what is queued -- when `BATCH` events are queued, and whenever the owner
    asks (`zerostate.watcher.watch.WatchHandle` does at the end of every engine call and before it
    reads or writes what the checker found).  Folding a few hundred events in one go costs a watched ZeRO-3
    step a few ms less than folding each between DeepSpeed's hooks (benchmarks/bench_watch.py).  No list of
    the run's events is kept."""

    def __init__(self, engine, sink=None):
        stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0
        super().__init__(engine, {"stage": stage, "blocks": []})
        self.sink = sink
        self._queue: collections.deque = collections.deque()
        self._delivering = False
        self.leaves = z3_leaf_modules(self.module) if stage == 3 else {}
        self.leaf_count = sum(1 for m in self.leaves.values() if any(p.requires_grad for p in m.parameters()))
        self._leaf_of: dict[str, str] = {}
        for lname, m in self.leaves.items():
            prefix = "" if lname == ROOT else lname + "."
            for pn, _ in m.named_parameters():
                self._leaf_of.setdefault(prefix + pn, lname)
        self._own: dict[str, tuple[str, ...]] = {}
        for mname, m in self.module.named_modules():
            mname = mname or ROOT
            prefix = "" if mname == ROOT else mname + "."
            rec = mname in self.leaves
            self._own[mname] = tuple(prefix + pn for pn, _ in m.named_parameters(recurse=rec))
        self.leaf_inputs: dict[str, bool] = {}
        """z3 leaf module -> whether any tensor input required grad at its last forward."""
        self._handles: list = []
        self._by_name = dict(self.params)
        self._own_items = {m: [(n, self._by_name[n]) for n in ns if n in self._by_name] for m, ns in self._own.items()}
        """module -> its own (name, parameter) pairs in parameter order (`_poll_module`'s usual scan)."""
        self._own_sets = {m: frozenset(ns) for m, ns in self._own.items()}
        self._order = {n: i for i, (n, _) in enumerate(self.params)}
        self._dirty: set[str] = set()
        self._gather_seen = False
        """The coordinator's all-gather is wrapped (else every module hook scans every parameter)."""
        self.steps = 0
        self.backwards = 0
        self._recompute_depth = 0
        self._engine_calls = 0
        """engine.forward / engine.backward calls in progress (a backward made there is not the user's own)."""
        self._plain: str | None = None
        """The kind (``torch`` / ``nonscalar``) of a PyTorch-style backward in progress whose window is not open yet."""
        self._plain_open: str | None = None
        """The kind of the PyTorch-style backward whose window is open."""
        self._trace_synced = True
        """The trace mode is reported (TRACE_STATE): from the start, or for an engine watched after its trace was
        recorded, from DeepSpeed's next invalidation (`_poll_trace`)."""
        self.on_trace_sync = None
        self._raw_trace = self.coord is not None and hasattr(self.coord, _TRACE_MODE)
        self._mode_raw = None
        """The coordinator's ``__trace_mode`` object at the last poll (`_poll_trace`)."""

    def _resync(self) -> None:
        super()._resync()
        self._mode_raw = None  # `_mode` was set from DeepSpeed: the next poll compares again

    def params_of(self, module: str) -> tuple[str, ...]:
        """The parameters ZeRO-3 fetches for ``module``: its own, or all under it for a z3 leaf module."""
        return self._own.get(module, ())

    # ------------------------------------------------------------ events
    def emit(self, kind: str, param=None, module=None, task=None, value=None, phase=None, note=None) -> None:
        """Queue the `Event` for ``sink`` (not a dict: no ``Event.from_dict`` per event).  Events are immutable
        and a job repeats the same ones every step (a parameter's fetch, holders, release...), so equal events
        are one shared object from `_EVENTS` (the online checker's transition memo keys on it)."""
        if self._paused or self.sink is None:
            return
        key = (kind, param, module, task, value, phase, note)
        ev = _EVENTS.get(key)
        if ev is None:
            if len(_EVENTS) >= _EVENTS_MAX:
                _EVENTS.clear()
            ev = _EVENTS[key] = Event(EventKind(kind), param, module, task, value, phase, note)
        q = self._queue
        q.append(ev)  # (a deque: appends from another thread while `deliver` runs are neither lost nor reordered)
        if len(q) >= BATCH:
            self.deliver()

    def deliver(self) -> None:
        """Hand ``sink`` every queued event, in order.  A call made while the sink runs (the checker reporting a
        violation writes the report, which asks for delivery) returns at once: the outer call goes on."""
        if self._delivering or self.sink is None:
            return
        with self._lock:
            if self._delivering:
                return
            self._delivering = True
            try:
                self.sink(self._queue)  # it takes them from the left (an interrupted fold leaves the rest queued)
            finally:
                self._delivering = False

    def on_checkpoint(self, what: str, param: str) -> None:
        """A frozen parameter saved live by a recompute (``save_live``), checked by torch (``check``) or read
        by the backward (``use``)."""
        if self.stage != 3:
            return
        module = param.rsplit(".", 1)[0]
        self._poll_module(module, (param,))
        if what == "save_live":
            self.emit("save_live", param=param, module=module)
        else:
            self.emit("unpack", param=param, module=module, note=what)

    def on_recompute(self, fn, start: bool) -> None:
        if self.stage != 3 or torch._C._current_graph_task_id() == -1:
            return
        name = self.mod_names.get(id(_checkpointed_module(fn)), "checkpoint")
        if start:
            self._task()
            self._recompute_depth += 1
            self.emit("recompute_start", module=name)
        else:
            self._poll_module(None)
            self._recompute_depth = max(0, self._recompute_depth - 1)
            self.emit("recompute_end", module=name)

    # ------------------------------------------------------------ install
    def install(self) -> "WatchTracer":
        super().install()
        self._report_gathered()
        eng = self.engine
        self._patch(eng, "forward", self._w_forward)
        self._patch(eng, "backward", self._w_backward)
        self._patch(eng, "step", self._w_step)
        if self.coord is not None and hasattr(self.coord, _GATHER):
            self._patch(self.coord, _GATHER, self._w_all_gather)
            self._gather_seen = True
        for lname, m in self.leaves.items():
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs, n=lname: self._leaf_input(n, args, kwargs), with_kwargs=True))
        _ACTIVE.append(self)
        _install_checkpoint_observer()
        _install_backward_observer()
        self._trace_synced = self._mode in (None, "INVALID")
        return self

    def _report_gathered(self) -> None:
        """An engine watched after it has run: the parameters DeepSpeed holds gathered now (persistent ones
        after a step) are reported as fetched / prefetched with their holders, so the specs start from
        DeepSpeed's state (`Tracer._resync` takes it as already reported; ``available-when-used`` would then
        see a module compute with parameters it never saw fetched)."""
        if self.stage != 3:
            return
        for n, _ in self.params:
            st = self._emitted.get(n)
            if st == "AVAILABLE":  # note: not an all-gather of this run (the memory figures skip it)
                self.emit("fetch", param=n, note=WATCH_START)
            elif st == "INFLIGHT":
                self.emit("prefetch", param=n, module=n.rsplit(".", 1)[0], note=WATCH_START)
            if self._holders.get(n, 0):
                self.emit("holders", param=n, value=self._holders[n], note="+")

    def uninstall(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if not _ACTIVE:
            _uninstall_checkpoint_observer()
            _uninstall_backward_observer()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        super().uninstall()

    def _leaf_input(self, name, args, kwargs) -> None:
        ts = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.leaf_inputs[name] = any(t.requires_grad for t in ts)

    # ------------------------------------------------------------ the loop, from the engine's calls
    def _w_forward(self, f):
        def forward(*a, **k):
            ev = not torch.is_grad_enabled() or not self.module.training
            self.mark("eval_start" if ev else "forward_start")
            self._engine_calls += 1
            try:
                r = f(*a, **k)
            finally:
                self._engine_calls -= 1
            self.mark("eval_end" if ev else "forward_end")
            return r
        return forward

    def _w_backward(self, f):
        def backward(*a, **k):
            self.backwards += 1
            self.mark("backward_start", kind="engine")
            self._engine_calls += 1
            try:
                r = f(*a, **k)
            finally:
                self._engine_calls -= 1
            self.mark("backward_end", kind="engine")
            return r
        return backward

    # ------------------------------------------------------------ PyTorch-style backward (loss.backward())
    def _task(self):
        """As `Tracer._task`; the first graph task of a PyTorch-style backward that reaches this engine opens
        its user-backward window first (USER_BACKWARD_START, note ``torch`` / ``nonscalar``): the window opens
        only for the engines the backward reaches."""
        if self._plain is not None and torch._C._current_graph_task_id() != -1:
            kind, self._plain = self._plain, None
            self._plain_open = kind
            self.backwards += 1
            self.mark("backward_start", kind=kind)
        tid = torch._C._current_graph_task_id()  # (`Tracer._task`'s usual case, inlined: a task already seen)
        if tid == -1:
            return None
        small = self._tasks.get(tid)
        return small if small is not None else super()._task()

    def _plain_backward_end(self) -> None:
        self._plain = None
        if self._plain_open is not None:
            kind, self._plain_open = self._plain_open, None
            self.mark("backward_end", kind=kind)

    def _poll_trace(self) -> None:
        """As `Tracer._poll_trace`.  An engine watched after DeepSpeed recorded its module trace: the recorded
        order is unknown, so TRACE_STATE is reported (and ``trace-consistent`` judged, from its initial state)
        only from DeepSpeed's next invalidation on -- before, the trace is not reported, as for a target that
        does not report it."""
        if self.stage != 3 or self._paused:
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
        if mode != self._mode:
            self._mode = mode
            if self._trace_synced:
                self.emit("trace_state", note=mode)
            elif mode == "INVALID":
                self._trace_synced = True
                if self.on_trace_sync is not None:
                    self.on_trace_sync()

    def _w_step(self, f):
        def step(*a, **k):
            boundary = self.engine.is_gradient_accumulation_boundary()
            if boundary:
                self.mark("step", step=self.steps)
            r = f(*a, **k)
            if boundary:
                self.steps += 1
            return r
        return step

    # ------------------------------------------------------------ user names
    def _w_module(self, f, what):
        kind = "module_" + what
        forward = what in ("pre_forward", "post_forward")
        names = self.mod_names

        def wrapped(module, *a, **k):
            task = self._task()
            name = names.get(id(module), "?")
            phase = None
            if forward:
                phase = "eval" if self._eval else ("recompute" if task is not None else "forward")
            self._poll_trace()
            self.emit(kind, None, name, None, None, phase)
            r = f(module, *a, **k)
            self._poll_module(name)
            return r
        return wrapped

    def _poll(self, module: str | None = None) -> None:
        """As `Tracer._poll`, but a parameter that became gathered is a PREFETCH only if its all-gather is
        still in flight (``ds_status`` INFLIGHT), else a FETCH for the hooked module: a user's model fetches
        parameters outside their owner's hook (peft reads ``lora_A.weight`` in ``Linear.forward``; external
        parameters), which `Tracer`'s name rule would call prefetches.  Scans every parameter."""
        if self.stage != 3 or self._paused:
            return
        self._dirty.clear()
        self._scan(self.params, module)

    def _poll_module(self, module: str | None, extra=()) -> None:
        """After a module hook: only the module's own parameters (what its fetch / release touches) and those
        all-gathered since the last poll (prefetches, external parameters) can have changed -- DeepSpeed's
        other releases (``release_and_reset_all``) run in the epilogue and step, where `_poll` scans all.
        Scanning all ~P parameters after each of ~M module hooks made watching O(M x P) per step."""
        if self.stage != 3 or self._paused:
            return
        if not self._gather_seen:
            self._poll(module)
            return
        dirty = self._dirty
        own = self._own_items.get(module, ())
        if not extra and (not dirty or dirty.issubset(self._own_sets[module] if own else ())):
            dirty.clear()  # the usual hook: only the module's own parameters were all-gathered
            self._scan(own, module)
            return
        names = set(self._own.get(module, ())) | dirty | set(extra)
        dirty.clear()
        self._scan([(n, self._by_name[n]) for n in sorted(names, key=self._order.__getitem__)
                    if n in self._by_name], module)

    def _scan(self, items, module: str | None) -> None:
        status, emitted, hold = compat.param_status, self._emitted, self._holders
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
                self.emit("holders", param=n, module=module, value=h_new, note="-")
            if new == "NOT_AVAILABLE" and em != "NOT_AVAILABLE":
                self.emit("release", param=n, module=n.rsplit(".", 1)[0])
            elif new == "INFLIGHT" and em in (None, "NOT_AVAILABLE"):
                self.emit("prefetch", param=n, module=n.rsplit(".", 1)[0])
            elif new == "AVAILABLE" and em in (None, "NOT_AVAILABLE"):
                self.emit("fetch", param=n, module=module)
            elif new == "AVAILABLE" and em == "INFLIGHT":
                self.emit("fetch", param=n, module=module, note="inflight")
            emitted[n] = new
            if h_new > h_old:
                hold[n] = h_new
                self.emit("holders", param=n, module=module, value=h_new, note="+")
        self._poll_trace()

    def _w_all_gather(self, f):
        def all_gather(params, *a, **k):
            names = self.param_names
            self._dirty.update(names[id(p)] for p in params if id(p) in names)
            return f(params, *a, **k)
        return all_gather

    def _leaf_module_of(self, param_name: str) -> str:
        """The user's z3 leaf module holding ``param_name`` (any depth), else the parameter's own module."""
        return self._leaf_of.get(param_name, param_name.rsplit(".", 1)[0])


__all__ = ["WATCH_START", "WatchTracer", "z3_leaf_modules"]
