"""The harness's tracer: `TraceCore` on zerostate's own network, its events kept as a list of dicts.

``Tracer(engine, scenario).install()`` in the worker (`zerostate.harness.executor`; the `Scenario` the worker
parsed); ``tracer.events`` (dicts, what crosses back to the parent process), ``tracer.mark(what)`` from the training
loop, ``tracer.paused()`` around the harness's own reads of the parameters, ``tracer.uninstall()``.  The network's names
(``blocks.<i>.norm`` / ``.lin`` / ``head``) say what the module hooks are (`NetworkView`):

=====================================  ==============================================================
observed                               events
=====================================  ==============================================================
ZeRO-3 offload pre/post fwd/bwd        MODULE_PRE/POST_FORWARD (phase forward | recompute | eval),
                                       MODULE_PRE/POST_BACKWARD (root as ``model``, sub-modules, leaf
                                       blocks, head), CONTAINER_HOOK (a non-leaf block); SAVE_LIVE at a
                                       recompute pre-forward and UNPACK(use) at a pre-backward, for frozen
                                       params of non-reentrant blocks (torch keeps live references to them)
checkpointed block calls               RECOMPUTE_START/END inside a graph task (``marks.BLOCK_OBSERVER``,
                                       also when torch stops a non-reentrant recompute early),
                                       UNPACK(check) for frozen params of non-reentrant blocks
z3 leaf parameters' accumulated grads  LEAF_GRAD (a post-accumulate-grad hook of the tracer's own)
=====================================  ==============================================================

The rest (loop marks, graph tasks, the hook-state manager, gradient hooks, parameter statuses) is the core's
(`zerostate.tracing.core`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from zerostate.model.events import EventKind
from zerostate.model.scenario import SUBMODULES, Block, Checkpoint, ParamKind, Scenario

from zerostate.tracing import marks
from zerostate.tracing.core import MODULE_HOOK_KINDS, ROOT, TraceCore, Wrapper


class ListSink:
    """Each event as its dict (the serialised form the worker sends back), appended to ``events``."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def put(self, kind: EventKind, param: str | None, module: str | None, task: int | None, value: Any,
            phase: str | None, note: str | None) -> None:
        ev: dict[str, Any] = {"kind": kind.value}
        for k, v in (("param", param), ("module", module), ("task", task), ("value", value), ("phase", phase),
                     ("note", note)):
            if v is not None:
                ev[k] = v
        self.events.append(ev)


class NetworkView:
    """zerostate's network seen by the core: which module hooks are events, the z3 leaf blocks, the frozen
    parameters a non-reentrant block's recompute keeps live references to."""

    def __init__(self, core: TraceCore, scenario: Scenario) -> None:
        self.core = core
        self.blocks = scenario.blocks
        stage = core.stage
        self.leaf_blocks = {i for i, b in enumerate(self.blocks) if b.leaf and stage == 3}
        self.leaf_count = len(self.leaf_blocks) if stage == 3 else 0
        self.recomputed: set[int] = set()
        """Non-reentrant blocks recomputed in the current user backward."""

    def leaf_module_of(self, param: str) -> str:
        """The z3 leaf module whose backward hook handles ``param`` (the scenario's ``blocks.<i>``)."""
        return ".".join(param.split(".")[:2])

    def block_info(self, name: str) -> tuple[int | None, Block | None]:
        parts = name.split(".")
        if len(parts) >= 2 and parts[0] == "blocks":
            i = int(parts[1])
            return i, self.blocks[i]
        return None, None

    def frozen_params(self, module_name: str) -> list[str]:
        i, b = self.block_info(module_name)
        if b is None:
            return []
        subs = ("norm", "lin") if module_name.count(".") == 1 else (module_name.split(".")[2],)
        return [f"blocks.{i}.{s}.{p}" for s in subs if s in SUBMODULES and b.kind_of(s) is ParamKind.FROZEN
                for p in ("weight", "bias")]

    def module_hook(self, what: str, f: Wrapper) -> Wrapper:
        core = self.core
        kind = MODULE_HOOK_KINDS[what]

        def wrapped(module: torch.nn.Module, *a: Any, **k: Any) -> Any:
            task = core.task()
            name = core.mod_names.get(id(module))
            i, b = self.block_info(name or "")
            is_block = name is not None and i is not None and name.count(".") == 1
            leaf = is_block and i in self.leaf_blocks
            tracked = name in (ROOT, "head") or (i is not None and (not is_block or leaf))
            phase = None
            if what in ("pre_forward", "post_forward"):
                phase = "eval" if core.eval else ("recompute" if task is not None else "forward")
            nonre = b is not None and b.checkpoint is Checkpoint.NON_REENTRANT
            core.poll_trace()
            if tracked:
                core.emit(kind, module=name, phase=phase)
            elif is_block:  # a non-leaf Block: a parameter-less container DeepSpeed traces like any module
                core.emit(EventKind.CONTAINER_HOOK, module=name, phase=phase, note=what)
            r = f(module, *a, **k)
            core.poll(name if tracked else None)
            if tracked and nonre and what == "pre_forward" and phase == "recompute":
                for p in self.frozen_params(name or ""):  # torch keeps live references to these
                    core.emit(EventKind.SAVE_LIVE, param=p, module=f"blocks.{i}")
            if tracked and nonre and what == "pre_backward" and i in self.recomputed:
                for p in self.frozen_params(name or ""):  # the module's backward unpacks them
                    core.emit(EventKind.UNPACK, param=p, module=f"blocks.{i}", note="use")
            return r
        return wrapped

    def watch_leaf_grads(self) -> None:
        """LEAF_GRAD when a z3 leaf block's parameter's gradient has accumulated (a post-accumulate-grad hook of the
        tracer's own, registered before any hook a backward adds: it reports first)."""
        core = self.core
        for n, p in core.params:
            parts = n.split(".")
            if parts[0] == "blocks" and int(parts[1]) in self.leaf_blocks and p.requires_grad:
                handle = p.register_post_accumulate_grad_hook(lambda _p, n=n: self._leaf_grad(n))
                core.patcher.on_undo(handle.remove)

    def _leaf_grad(self, name: str) -> None:
        self.core.emit(EventKind.LEAF_GRAD, param=name, task=self.core.task())
        self.core.flush()

    def block_enter(self, blk: torch.nn.Module) -> None:
        core = self.core
        if core.stage == 3 and torch._C._current_graph_task_id() != -1 and not core.paused_depth:
            core.task()
            core.emit(EventKind.RECOMPUTE_START, module=core.mod_names.get(id(blk)))

    def block_exit(self, blk: torch.nn.Module) -> None:
        core = self.core
        if core.stage != 3 or torch._C._current_graph_task_id() == -1 or core.paused_depth:
            return
        name = core.mod_names.get(id(blk), "?")
        i, b = self.block_info(name)
        core.poll()
        core.emit(EventKind.RECOMPUTE_END, module=name)
        if b is not None and b.checkpoint is Checkpoint.NON_REENTRANT and i is not None:
            self.recomputed.add(i)
            skipped = f"{name}.norm." if getattr(blk, "norm_skipped", False) else None  # a branch: norm not run
            for p in self.frozen_params(name):
                if skipped is None or not p.startswith(skipped):
                    core.emit(EventKind.UNPACK, param=p, module=name, note="check")


class Tracer:
    """The worker's tracer of one engine running ``scenario`` (parsed once, by the worker that received it)."""

    def __init__(self, engine: Any, scenario: Scenario) -> None:
        self.scenario = scenario
        self._sink = ListSink()
        self.core = TraceCore(engine, scenario.stage, self._sink)
        self.view = NetworkView(self.core, scenario)

    @property
    def events(self) -> list[dict[str, Any]]:
        return self._sink.events

    def install(self) -> Tracer:
        marks.BLOCK_OBSERVER = (self.view.block_enter, self.view.block_exit)
        self.core.install(self.view)
        if self.core.stage == 3:
            self.view.watch_leaf_grads()
        return self

    def uninstall(self) -> None:
        self.core.uninstall()
        marks.BLOCK_OBSERVER = None

    def rebind(self, engine: Any) -> None:
        """Observe ``engine`` from now on (a resume built a fresh one): the old engine's hooks let go, the new
        one's observed as a new engine's are, into the same events."""
        self.uninstall()
        self.core = TraceCore(engine, self.scenario.stage, self._sink)
        self.view = NetworkView(self.core, self.scenario)
        self.install()
        self.core.emit(EventKind.ENGINE_START)
        self.core.emitted.clear()  # what the fresh engine holds gathered already (ZeRO-3's persistent parameters)
        self.core.holders.clear()  # is reported to the fresh monitors, not taken as known
        self.core.poll()

    def mark(self, what: str, **info: Any) -> None:
        if what == "backward_start":
            self.view.recomputed.clear()
        self.core.mark(what, **info)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.core.paused()


__all__ = ["ListSink", "NetworkView", "ROOT", "Tracer"]
