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

import torch

from zerostate.model.events import EventKind, Event

from zerostate.tracing import compat
from zerostate.tracing.tracer import ROOT, Tracer
from zerostate.watcher.torch_observers import ACTIVE as _ACTIVE, checkpointed_module, install_observers, \
    uninstall_observers

_TRACE_MODE = "_PartitionedParameterCoordinator__trace_mode"
"""partitioned_param_coordinator.py ``self.__trace_mode`` (a ``ZeRoTraceMode``), what ``is_record_trace()`` /
``is_complete_trace()`` compare (0.18.4-0.19.8): `WatchTracer._poll_trace` reads it once per module hook instead
of calling both."""
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
        self.recomputes_observed = 0
        """Non-reentrant checkpoint recomputes (torch's ``_run_fn_with_dynamo_disabled``, observed in full)."""
        self.recomputes_unobserved = 0
        """Module pre-forwards inside a backward outside those: a reentrant checkpoint's recompute, whose saved
        tensors the watch does not observe."""
        self._recompute_depth = 0
        self._bwd_pre: dict[str, torch.nn.Module] = {}
        """Modules whose pre-backward ran in the current user backward (name -> module)."""
        self._bwd_post: set[str] = set()
        self.backward_leftovers: dict[str, str] = {}
        """After the last user backward: parameter -> the module whose pre-backward fetched it and whose
        post-backward never ran, for parameters still gathered or held then (what 0.19.3's epilogue drains)."""
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
        name = self.mod_names.get(id(checkpointed_module(fn)), "checkpoint")
        if start:
            self._task()
            self.recomputes_observed += 1
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
        off = compat.offload(self.opt) if self.stage == 3 else None
        if off is not None and hasattr(off, "_register_deepspeed_module"):
            self._patch(off, "_register_deepspeed_module", lambda f: self._w_register(f, off.module))
        for lname, m in self.leaves.items():
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs, n=lname: self._leaf_input(n, args, kwargs), with_kwargs=True))
        _ACTIVE.append(self)
        install_observers()
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
            uninstall_observers()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        super().uninstall()

    def _w_register(self, f, root):
        """Hooks registered again on the root module after the engine was built (TRL's
        ``unwrap_model_for_generation`` at ZeRO-3: ``remove_hooks``, generate, ``add_hooks``, which invalidates the
        coordinator's trace and calls ``_register_deepspeed_module``): REREGISTER, which calls for the INVALID trace
        that follows, as the explorer's re-registration reports it."""
        def register(module, *a, **k):
            if module is not root:  # its own recursion over the children
                return f(module, *a, **k)
            self.emit(EventKind.REREGISTER)
            r = f(module, *a, **k)
            self._poll()
            return r
        return register

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

    def mark(self, what: str, **info) -> None:
        if what == "backward_start":
            self._bwd_pre.clear()
            self._bwd_post.clear()
        elif what == "backward_end":
            self.backward_leftovers = self._leftovers()
        super().mark(what, **info)

    def _leftovers(self) -> dict[str, str]:
        """Parameters of modules whose pre-backward ran and post-backward did not (torch calls a module's backward
        hook only when an input requires grad: token ids never do) still gathered or held now."""
        out: dict[str, str] = {}
        if self.stage != 3:
            return out
        for name, mod in self._bwd_pre.items():
            if name in self._bwd_post:
                continue
            external = getattr(mod, "ds_external_parameters", None)
            params = [p for _, p in mod.named_parameters(recurse=name in self.leaves)]
            params += [p for _, p in external()] if callable(external) else []
            for p in params:
                full = self.param_names.get(id(p))
                if full and (compat.param_status(p) != "NOT_AVAILABLE" or compat.holders(p)):
                    out.setdefault(full, name)
        return out

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
        pre_bwd, post_bwd = self._bwd_pre if what == "pre_backward" else None, \
            self._bwd_post if what == "post_backward" else None

        def wrapped(module, *a, **k):
            task = self._task()
            name = names.get(id(module), "?")
            if pre_bwd is not None:
                pre_bwd[name] = module
            elif post_bwd is not None:
                post_bwd.add(name)
            phase = None
            if forward:
                phase = "eval" if self._eval else ("recompute" if task is not None else "forward")
                if task is not None and not self._recompute_depth and what == "pre_forward":
                    self.recomputes_unobserved += 1  # a reentrant checkpoint's (or a custom backward's) forward
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
