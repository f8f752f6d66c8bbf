"""Observe real DeepSpeed's hook lifecycle and record it as zerostate events, without editing DeepSpeed.

`Tracer.install()` rebinds, on *instances* (the engine, its ZeRO optimizer, the
hook-state manager, the ZeRO-3 offload object and parameter coordinator) and in
two modules (``count_used_parameters_in_backward`` as imported by stage3 and
stage_1_and_2), a thin wrapper around each observed function;
`Tracer.uninstall()` puts every original back.  Release differences come from
`compat`.  What each wrapper records (kinds are `zerostate.model.events.EventKind` values):

=====================================  ==============================================================
observed                               events
=====================================  ==============================================================
training loop marks (executor)         FORWARD_START/END, EVAL_FORWARD_START/END, USER_BACKWARD_START/END
                                       (note = backward kind), STEP (value = train step)
first sight of a graph task            TASK_START (note outer / nested / pre; task ids renumbered 0, 1, ..
                                       by first sight); TASK_END from a callback queued on that task
engine._backward_prologue              OUTPUT_HOOK
hook-state enter/exit_backward         ENTER_BACKWARD / EXIT_BACKWARD (value = depth after)
queue_post_backward_callback           CALLBACK_QUEUED (when it newly queued)
run_grad_acc_post_hooks                CALLBACK_RUN (when called from the queued callback), POST_HOOKS
engine._backward_epilogue              BUCKET_FLUSH (gradients handled since the last flush), EPILOGUE
gradient sink (reduce / process)       GRAD_HOOK or LEAF_HOOK (by the calling hook closure), BUCKET_ADD
z3 leaf parameters' accumulated grads  LEAF_GRAD (a post-accumulate-grad hook of the tracer's own)
count_used_parameters_in_backward      COUNT (task, value = result + ZeRO-3 leaf-module count)
stage3 _pre_step                       BUCKET_CLEAR (value = stale params found in the real ipg buckets)
ZeRO-3 offload pre/post fwd/bwd        MODULE_PRE/POST_FORWARD (phase forward | recompute | eval),
                                       MODULE_PRE/POST_BACKWARD (root as ``model``, sub-modules, leaf
                                       blocks, head); SAVE_LIVE at a recompute pre-forward and
                                       UNPACK(use) at a pre-backward, for frozen params of
                                       non-reentrant blocks (torch keeps live references to them)
checkpointed block calls               RECOMPUTE_START/END inside a graph task (``marks.BLOCK_OBSERVER``,
                                       also when torch stops a non-reentrant recompute early),
                                       UNPACK(check) for frozen params of non-reentrant blocks
parameter ds_status / holders / mode   FETCH (note ``inflight``: waited on a prefetch) / PREFETCH /
                                       RELEASE / HOLDERS / PERSISTENT / TRACE_STATE, polled after every
                                       coordinator call, epilogue, step and loop mark
=====================================  ==============================================================
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading

import torch

from zerostate.runtime.patcher import Patcher

from zerostate.tracing import compat, marks

ROOT = "model"
"""The root module's name in events (torch names it ``""``), as in ``zerostate.model.network``."""


class Tracer:
    def __init__(self, engine, spec: dict):
        self.engine = engine
        self.opt = engine.optimizer
        self.spec = spec
        self.stage = spec.get("stage", 3)
        self.events: list[dict] = []
        self._lock = threading.RLock()
        self._patcher = Patcher()
        self._tasks: dict[int, int] = {}
        self._stack: list[int] = []
        self._pending: list[int] = []
        self._in_pre = False
        self._eval = False
        self._paused = 0
        self._bucket: set[str] = set()
        self._leaf_frame = None
        self._nest = 0
        self.module = engine.module
        self.param_names = {id(p): n for n, p in self.module.named_parameters()}
        self.params = list(self.module.named_parameters())
        blocks = spec.get("blocks", [{}])
        self.leaf_blocks = {i for i, b in enumerate(blocks) if b.get("leaf") and self.stage == 3}
        self.leaf_count = len(self.leaf_blocks) if self.stage == 3 else 0
        self.mod_names = {id(m): (n or ROOT) for n, m in self.module.named_modules()}
        self.coord = compat.coordinator(self.opt) if self.stage == 3 else None
        self._emitted: dict[str, str] = {}
        self._holders: dict[str, int] = {}
        self._mode: str | None = None
        self._recomputed: set[int] = set()
        self._declared = False

    # ------------------------------------------------------------ emitting
    def emit(self, kind: str, **kw) -> None:
        if self._paused:
            return
        ev = {"kind": kind}
        ev.update({k: v for k, v in kw.items() if v is not None})
        with self._lock:
            self.events.append(ev)

    @contextlib.contextmanager
    def paused(self):
        self._poll()  # report what happened before the pause (e.g. engine.step()'s persistent re-gather)
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._resync()

    def _task(self):
        tid = torch._C._current_graph_task_id()
        if tid == -1:
            return None
        small = self._tasks.get(tid)
        if small is None:
            small = len(self._tasks)
            self._tasks[tid] = small
            if self._in_pre:
                note, parent = "pre", None
            elif self._stack:
                note, parent = "nested", self._stack[-1]
            else:
                note, parent = "outer", None
            self.emit("task_start", task=small, value=parent, note=note)
            self._stack.append(small)
            self._pending.append(small)
        return small

    def _flush(self) -> None:
        """Queue TASK_END callbacks for newly seen tasks, after DeepSpeed's own callback."""
        if self._nest or not self._pending or torch._C._current_graph_task_id() == -1:
            return
        eng = torch.autograd.Variable._execution_engine
        cur = self._tasks.get(torch._C._current_graph_task_id())
        for small in list(self._pending):
            if small == cur:
                eng.queue_callback(lambda s=small: self._task_end(s))
                self._pending.remove(small)

    def _task_end(self, small: int) -> None:
        self.emit("task_end", task=small)
        if small in self._stack:
            self._stack.remove(small)

    # ------------------------------------------------------------ statuses
    def _resync(self) -> None:
        """Take DeepSpeed's current parameter state as already reported (after a paused section)."""
        if self.stage != 3:
            return
        for n, p in self.params:
            st = compat.param_status(p)
            self._emitted[n] = "AVAILABLE" if st == "AVAILABLE" else ("INFLIGHT" if st == "INFLIGHT" else
                                                                       "NOT_AVAILABLE")
            self._holders[n] = compat.holders(p)
        self._mode = compat.trace_mode(self.coord)

    def _poll(self, module: str | None = None) -> None:
        """Report status and holder changes since the last poll.  ``module``: the hooked module whose
        fetch / release just ran.  A parameter that became gathered is a FETCH, one still in flight a
        PREFETCH, whichever module owns it."""
        if self.stage != 3 or self._paused:
            return
        for n, p in self.params:
            new, em = compat.param_status(p), self._emitted.get(n)
            owner = n.rsplit(".", 1)[0]
            h_old, h_new = self._holders.get(n, 0), compat.holders(p)
            if h_new < h_old:
                self._holders[n] = h_new
                self.emit("holders", param=n, module=module, value=h_new, note="-")
            if new == "NOT_AVAILABLE" and em != "NOT_AVAILABLE":
                self.emit("release", param=n, module=owner)
                self._emitted[n] = new
            elif new != "NOT_AVAILABLE" and em in (None, "NOT_AVAILABLE"):
                # the status says which: still in flight is a prefetch (also one issued by an untraced Block
                # container's hook, module None); gathered is a fetch, also of a parameter another module
                # owns (an on-demand gather: a ZeRO-3 external parameter, a Linear inside a z3 leaf block)
                if new != "INFLIGHT":
                    self.emit("fetch", param=n, module=module)
                    self._emitted[n] = "AVAILABLE"
                else:
                    self.emit("prefetch", param=n, module=owner)
                    self._emitted[n] = "INFLIGHT"
            elif em == "INFLIGHT" and new == "AVAILABLE":  # waited on: by its owner, an untraced module's
                # hook, or an invalidation's in-flight cleanup (kept because someone holds it)
                self.emit("fetch", param=n, module=module, note="inflight")
                self._emitted[n] = "AVAILABLE"
            if h_new > h_old:
                self._holders[n] = h_new
                self.emit("holders", param=n, module=module, value=h_new, note="+")
        self._poll_trace()

    def _poll_trace(self) -> None:
        if self.stage != 3 or self._paused:
            return
        mode = compat.trace_mode(self.coord)
        if mode != self._mode:
            self._mode = mode
            self.emit("trace_state", note=mode)

    # ------------------------------------------------------------ patching
    def _patch(self, obj, attr: str, make) -> None:
        """Wrap ``obj.attr`` with ``make(original)``; events emitted inside are flushed when the outermost
        wrapped call returns.  Nothing happens when ``obj`` is None or lacks ``attr`` (another release)."""
        def wrapper(orig):
            inner = make(orig)

            def outer(*a, **k):
                self._nest += 1
                try:
                    return inner(*a, **k)
                finally:
                    self._nest -= 1
                    if not self._nest:
                        self._flush()
            outer.__wrapped__ = orig
            return outer
        self._patcher.wrap(obj, attr, wrapper)

    def uninstall(self) -> None:
        self._patcher.undo()
        self._leaf_frame = None
        marks.PRE_BACKWARD_OBSERVER = None
        marks.BLOCK_OBSERVER = None

    def install(self) -> "Tracer":
        marks.PRE_BACKWARD_OBSERVER = (self._pre_start, self._pre_end)
        marks.BLOCK_OBSERVER = (self._block_enter, self._block_exit)
        eng, opt = self.engine, self.opt
        if self.stage == 0:  # no ZeRO optimizer and no hook manager: the loop's marks only
            self._resync()
            return self
        self._patch(eng, "_backward_prologue", self._w_prologue)
        self._patch(eng, "_backward_epilogue", self._w_epilogue)
        owner = compat.hook_state_owner(opt)
        self._patch(owner, "enter_backward", lambda f: self._w_depth(f, "enter_backward"))
        self._patch(owner, "exit_backward", lambda f: self._w_depth(f, "exit_backward"))
        self._patch(owner, "run_grad_acc_post_hooks", self._w_post_hooks)
        self._patch(owner, "queue_post_backward_callback", self._w_queue)
        self._patch(opt, compat.grad_sink(self.stage), self._w_sink)
        for modname in compat.COUNT_MODULES:
            mod = importlib.import_module(modname)
            self._patch(mod, compat.COUNT_NAME, self._w_count)
        if self.stage == 3:
            self._patch(opt, "_pre_step", self._w_pre_step)
            # engine.step() partitions every parameter, then re-gathers the persistent ones: poll after each
            self._patch(opt, "_partition_all_parameters", self._w_polled)
            self._patch(opt, "_post_step", self._w_polled)
            off = compat.offload(opt)
            self._patch(off, "pre_sub_module_forward_function", lambda f: self._w_module(f, "pre_forward"))
            self._patch(off, "post_sub_module_forward_function", lambda f: self._w_module(f, "post_forward"))
            self._patch(off, "pre_sub_module_backward_function", lambda f: self._w_module(f, "pre_backward"))
            self._patch(off, "post_sub_module_backward_function", lambda f: self._w_module(f, "post_backward"))
            self._watch_leaf_grads()
        self._resync()
        return self

    def _watch_leaf_grads(self) -> None:
        """LEAF_GRAD when a z3 leaf block's parameter's gradient has accumulated (a post-accumulate-grad hook
        of the tracer's own, registered before any hook a backward adds: it reports first)."""
        for n, p in self.params:
            parts = n.split(".")
            if parts[0] == "blocks" and int(parts[1]) in self.leaf_blocks and p.requires_grad:
                handle = p.register_post_accumulate_grad_hook(lambda _p, n=n: self._leaf_grad(n))
                self._patcher.on_undo(handle.remove)

    def _leaf_grad(self, name: str) -> None:
        self.emit("leaf_grad", param=name, task=self._task())
        self._flush()

    # ------------------------------------------------------------ loop marks
    def mark(self, what: str, **info) -> None:
        self._poll()
        if what == "forward_start":
            self.emit("forward_start")
            self._declare_persistent()
        elif what == "forward_end":
            self.emit("forward_end")
        elif what == "eval_start":
            self._eval = True
            self.emit("eval_forward_start")
            self._declare_persistent()
        elif what == "eval_end":
            self._eval = False
            self.emit("eval_forward_end")
        elif what == "backward_start":
            self._recomputed.clear()
            self.emit("user_backward_start", note=info.get("kind"))
        elif what == "reregister":
            self.emit("reregister")
        elif what == "backward_end":
            self.emit("user_backward_end", note=info.get("kind"))
        elif what == "step":
            self.emit("step", value=info.get("step"))
        elif what == "save_load_start":  # a checkpoint round trip (``save_load``): no hook runs in it; ZeRO-3's
            self._paused += 1  # gathers (16-bit state dict, checkpoint prologue / epilogue) are not traced
        elif what == "save_load_end":
            self._paused -= 1
            self._poll()  # what it changed for good is reported (a parameter it released, at ZeRO-3)

    def _declare_persistent(self) -> None:
        if self.stage == 3 and not self._declared:
            self._declared = True
            for n, p in self.params:
                if compat.is_persistent(p):
                    self.emit("persistent", param=n)

    def _block_enter(self, blk) -> None:
        if self.stage == 3 and torch._C._current_graph_task_id() != -1 and not self._paused:
            self._task()
            self.emit("recompute_start", module=self.mod_names.get(id(blk)))

    def _block_exit(self, blk) -> None:
        if self.stage != 3 or torch._C._current_graph_task_id() == -1 or self._paused:
            return
        name = self.mod_names.get(id(blk), "?")
        i, b = self._block_info(name)
        self._poll()
        self.emit("recompute_end", module=name)
        if b is not None and b.get("checkpoint") == "non_reentrant":
            self._recomputed.add(i)
            skipped = f"{name}.norm." if getattr(blk, "norm_skipped", False) else None  # a branch: norm not run
            for p in self._frozen_params(name):
                if skipped is None or not p.startswith(skipped):
                    self.emit("unpack", param=p, module=name, note="check")

    def _pre_start(self) -> None:
        self._in_pre = True

    def _pre_end(self) -> None:
        self._in_pre = False

    # ------------------------------------------------------------ wrappers
    def _w_prologue(self, f):
        def prologue(*a, **k):
            self.emit("output_hook", task=self._task())
            r = f(*a, **k)
            self._flush()
            return r
        return prologue

    def _w_epilogue(self, f):
        def epilogue(*a, **k):
            task = self._task()
            self.emit("bucket_flush", value=len(self._bucket))
            self._bucket.clear()
            self.emit("epilogue", task=task)
            r = f(*a, **k)
            self._poll()
            self._flush()
            return r
        return epilogue

    def _w_depth(self, f, kind):
        def wrapped(*a, **k):
            self._task()
            r = f(*a, **k)
            self.emit(kind, value=compat.depth(self.opt))
            self._flush()
            return r
        return wrapped

    def _w_post_hooks(self, f):
        def post_hooks(*a, **k):
            task = self._task()
            if sys._getframe(2).f_code.co_name in compat.CALLBACK_FRAMES:
                self.emit("callback_run", task=task)
            if compat.depth(self.opt) == 0:
                note = "skipped: no active backward"
            elif getattr(self.engine, "_running_engine_backward", False):
                note = "deferred to engine.backward"
            else:
                note = "ran epilogue"
            self.emit("post_hooks", note=note)
            r = f(*a, **k)
            self._flush()
            return r
        return post_hooks

    def _w_queue(self, f):
        def queue(*a, **k):
            task = self._task()
            before = compat.callback_queued(compat.hook_state_owner(self.opt))
            r = f(*a, **k)
            if r and not before:
                self.emit("callback_queued", task=task)
            self._flush()
            return r
        return queue

    def _leaf_module_of(self, param_name: str) -> str:
        """The z3 leaf module whose backward hook handles ``param_name`` (the scenario's ``blocks.<i>``)."""
        return ".".join(param_name.split(".")[:2])

    def _w_sink(self, f):
        def sink(param, *a, **k):
            task = self._task()
            name = self.param_names.get(id(param), "?")
            frame = sys._getframe(2)
            if frame.f_code.co_name in compat.LEAF_HOOK_FRAMES:
                if frame is not self._leaf_frame:
                    self._leaf_frame = frame
                    self.emit("leaf_hook", module=self._leaf_module_of(name), task=task)
            else:
                self.emit("grad_hook", param=name, task=task)
            self.emit("bucket_add", param=name)
            self._bucket.add(name)
            r = f(param, *a, **k)
            self._flush()
            return r
        return sink

    def _w_count(self, f):
        def count(*a, **k):
            task = self._task()
            v = f(*a, **k)
            self.emit("count", task=task, value=int(v) + self.leaf_count)
            self._flush()
            return v
        return count

    def _w_pre_step(self, f):
        def pre_step(*a, **k):
            stale = compat.stale_bucket_count(self.opt)
            r = f(*a, **k)
            if stale and compat.stale_bucket_count(self.opt) < stale:
                self.emit("bucket_clear", value=stale)
                self._bucket.clear()
            self._poll()
            return r
        return pre_step

    def _w_polled(self, f):
        def polled(*a, **k):
            r = f(*a, **k)
            self._poll()
            return r
        return polled

    def _block_info(self, name: str):
        parts = name.split(".")
        if len(parts) >= 2 and parts[0] == "blocks":
            i = int(parts[1])
            return i, self.spec.get("blocks", [{}])[i]
        return None, None

    def _frozen_params(self, module_name: str) -> list[str]:
        i, b = self._block_info(module_name)
        if b is None:
            return []
        subs = ("norm", "lin") if module_name.count(".") == 1 else (module_name.split(".")[2],)
        return [f"blocks.{i}.{s}.{p}" for s in subs if b.get(s, "trainable") == "frozen" for p in ("weight", "bias")]

    def _w_module(self, f, what):
        def wrapped(module, *a, **k):
            task = self._task()
            name = self.mod_names.get(id(module))
            i, b = self._block_info(name or "")
            is_block = name is not None and i is not None and name.count(".") == 1
            leaf = is_block and i in self.leaf_blocks
            tracked = name in (ROOT, "head") or (i is not None and (not is_block or leaf))
            phase = None
            if what in ("pre_forward", "post_forward"):
                phase = "eval" if self._eval else ("recompute" if task is not None else "forward")
            nonre = b is not None and b.get("checkpoint") == "non_reentrant"
            self._poll_trace()
            if tracked:
                self.emit("module_" + what, module=name, phase=phase)
            elif is_block:  # a non-leaf Block: a parameter-less container DeepSpeed traces like any module
                self.emit("container_hook", module=name, phase=phase, note=what)
            r = f(module, *a, **k)
            self._poll(name if tracked else None)
            if tracked and nonre and what == "pre_forward" and phase == "recompute":
                for p in self._frozen_params(name):  # torch keeps live references to these
                    self.emit("save_live", param=p, module=f"blocks.{i}")
            if tracked and nonre and what == "pre_backward" and i in self._recomputed:
                for p in self._frozen_params(name):  # the module's backward unpacks them
                    self.emit("unpack", param=p, module=f"blocks.{i}", note="use")
            return r
        return wrapped
