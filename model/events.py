"""The one event vocabulary shared by the model, the runtime and the real-DeepSpeed tracer.

Events come in two families:

* **driver events**: what the user and PyTorch do (a forward starts, a graph
  task starts, a gradient hook fires, a module's backward begins).  The model
  generates them from a scenario; the tracer observes them in real DeepSpeed.
* **effect events**: what the design under test does in response (evaluate the
  expected-hook count, run the epilogue, put a gradient in a bucket, fetch or
  release a parameter).

Specs read traces of these events only, so one spec judges every target.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any


class EventKind(str, Enum):
    """Event kinds.  The docstring of each says where it happens in DeepSpeed / PyTorch."""

    # ---- driver: schedule -------------------------------------------------
    FORWARD_START = "forward_start"
    """``engine.forward`` entry: ``clear_backward_seen_flag()`` / ``reset_for_new_step()``."""
    FORWARD_END = "forward_end"
    EVAL_FORWARD_START = "eval_forward_start"
    """An eval-mode / ``no_grad`` forward between train steps (no backward follows)."""
    EVAL_FORWARD_END = "eval_forward_end"
    USER_BACKWARD_START = "user_backward_start"
    """The user's backward call; ``note`` is the `BackwardKind` value."""
    USER_BACKWARD_END = "user_backward_end"
    """The user's backward call returns (``engine.backward`` then runs its own epilogue)."""
    STEP = "step"
    """``engine.step()`` at the gradient accumulation boundary; ``value`` is the train-step index."""

    # ---- driver: autograd -------------------------------------------------
    TASK_START = "task_start"
    """An autograd graph task starts. ``task`` is its id, ``value`` its parent task (nested) or None.
    ``note``: ``outer`` (user backward), ``nested`` (reentrant checkpoint), ``pre`` (backward in forward)."""
    TASK_END = "task_end"
    """An autograd graph task finishes; callbacks queued on it run just before."""
    OUTPUT_HOOK = "output_hook"
    """The gradient hook DeepSpeed put on the forward outputs fires: the backward prologue."""
    GRAD_HOOK = "grad_hook"
    """A trainable parameter's gradient-accumulator hook fires (``param``, ``task``)."""
    LEAF_HOOK = "leaf_hook"
    """A z3 leaf module's full backward hook fires (``module``, ``task``).  When no input of the module
    requires grad, torch fires it as soon as the gradient of the module's *output* is known: before the
    module's pre-backward hook and before its parameters' gradients accumulate (`LEAF_GRAD`)."""
    LEAF_GRAD = "leaf_grad"
    """The gradient of a parameter of a z3 leaf module was accumulated into ``.grad`` (its AccumulateGrad
    node ran; ``param``, ``task``).  DeepSpeed hooks no such parameter itself (the leaf's full backward
    hook handles them all); this is what the leaf's reduction must wait for (known issue
    ``z3-leaf-input-without-grad``)."""

    # ---- driver: module hooks (ZeRO-3 coordinator) ------------------------
    MODULE_PRE_FORWARD = "module_pre_forward"
    """Module pre-forward hook; ``phase`` is ``forward``, ``recompute`` or ``eval``."""
    MODULE_POST_FORWARD = "module_post_forward"
    MODULE_PRE_BACKWARD = "module_pre_backward"
    MODULE_POST_BACKWARD = "module_post_backward"
    RECOMPUTE_START = "recompute_start"
    """A checkpointed block's forward is re-run during backward (``module`` is the block)."""
    RECOMPUTE_END = "recompute_end"
    SAVE_LIVE = "save_live"
    """Non-reentrant checkpoint's recompute saved a live (undetached) reference to frozen ``param``."""
    UNPACK = "unpack"
    """Saved tensors of a checkpointed block are unpacked / metadata-checked (``param``)."""
    REREGISTER = "reregister"
    """ZeRO-3's module hooks were removed and registered again (``_register_deepspeed_module`` on the
    root, e.g. around generation in TRL's ``unwrap_model_for_generation``)."""
    CONTAINER_HOOK = "container_hook"
    """A ZeRO-3 module hook of a parameter-less container (``blocks.{i}``, the ``Block`` holding ``norm``
    and ``lin``): DeepSpeed traces and "fetches" it like any module (nothing to gather, but its place
    in the trace, its prefetch and its step count are real).  ``note`` is the hook (``pre_forward``,
    ``post_forward``, ``pre_backward``, ``post_backward``), ``phase`` as for module hooks.  The model
    and the real-DeepSpeed tracer both report it; not in `DRIVER_EVENTS` (only ``trace-consistent``
    reads it: its pre-hooks are steps of the trace), and never an anchor of the coordinator
    projection."""

    # ---- effects: hook-count protocol ---------------------------------------
    ENTER_BACKWARD = "enter_backward"
    """``enter_backward()``; ``value`` is the new depth."""
    EXIT_BACKWARD = "exit_backward"
    """``exit_backward()``; ``value`` is the new depth."""
    COUNT = "count"
    """``count_used_parameters_in_backward`` evaluated in ``task``; ``value`` is what it returned: the parameters
    (ZeRO-3: outside z3 leaf modules) whose gradient the running graph task will accumulate."""
    EXPECTED = "expected"
    """The hook count DeepSpeed expects for the phase, derived from the COUNT just before it in ``task`` (ZeRO-3
    adds one per z3 leaf module): ``value``, as handed to its hook state (``update_hook_state_and_maybe_run_epilogue``;
    before 0.18.5, where the count is the remaining-hooks counter itself, the count plus the leaf modules)."""
    CALLBACK_QUEUED = "callback_queued"
    """A post-backward callback queued on graph task ``task`` (``queue_callback``)."""
    CALLBACK_RUN = "callback_run"
    POST_HOOKS = "post_hooks"
    """``run_grad_acc_post_hooks()`` called; ``note`` says whether it ran or was skipped."""
    EPILOGUE = "epilogue"
    """The backward epilogue ran (``_backward_epilogue``: flush and reduce buckets, exit backward)."""
    BUCKET_ADD = "bucket_add"
    """A gradient was handled: put into the reduce (ipg) bucket (``param``)."""
    BUCKET_FLUSH = "bucket_flush"
    """The buckets were reduced and emptied; ``value`` is how many gradients."""
    BUCKET_CLEAR = "bucket_clear"
    """Stale bucket entries dropped without reduction (``_pre_step``); ``value`` is how many."""

    # ---- effects: ZeRO-3 parameter coordinator ----------------------------
    FETCH = "fetch"
    """``param`` became AVAILABLE for ``module``'s fetch: an all-gather was issued and waited on, or
    (``note`` ``inflight``) an earlier prefetch was waited on, with no new all-gather."""
    PREFETCH = "prefetch"
    """All-gather of ``param`` issued early from the recorded trace."""
    RELEASE = "release"
    """``param`` partitioned (``param.data = empty(0)``): status NOT_AVAILABLE."""
    TRACE_STATE = "trace_state"
    """The coordinator's module trace changed state; ``note`` is RECORD / COMPLETE / INVALID,
    ``value`` the coordinator's step id (modules fetched since the root forward) when it changed."""
    HOLDERS = "holders"
    """``param.ds_active_sub_modules`` changed: ``module`` was added (``note`` ``+``) or removed (``-``);
    ``value`` is the number of holders after the change."""
    PERSISTENT = "persistent"
    """``param`` is persistent (``ds_persist``: at most ``stage3_param_persistence_threshold`` elements);
    declared once, before the coordinator's first fetch."""
    ENGINE_START = "engine_start"
    """A fresh engine of the run starts (a resume built one and loaded the checkpoint into it): its hook state and
    coordinator start over, so every spec's open obligations are judged there and its monitor starts again
    (`zerostate.model.fold.Fold`).  Not a driver event; no model design makes one."""
    USER_GATHER = "user_gather"
    """The loop entered (``note`` ``enter``) or left (``exit``) a ``deepspeed.zero.GatheredParameters`` context of
    its own (a read, an edit): the FETCH and RELEASE events between the two are the context's, not a module hook's
    (on exit it partitions what it gathered, persistent parameters included).  Not a driver event."""
    GRADIENTS_UNOBSERVED = "gradients_unobserved"
    """The tracer has no gradient sink to watch in this engine (ZeRO stage 0: no ZeRO optimizer, no gradient hook):
    a backward without GRAD_HOOK, LEAF_HOOK or BUCKET_ADD events made gradients nobody observed, not none.  Declared
    once, as the engine's first forward begins; read by a finding's step context
    (`findings.fingerprint.step_context`), never by a spec.  Not a driver event."""
    ROLE = "role"
    """What ``param`` is in the model as a forward begins, where it is not a plain trainable parameter: ``note``
    ``frozen`` (``requires_grad`` off; again ``trainable`` when it is back on) or ``leaf`` (a z3 leaf module's);
    declared when it changes.  Read by a finding's fingerprint (`findings.fingerprint.roles`), never by a spec."""


DRIVER_EVENTS = frozenset({
    EventKind.FORWARD_START, EventKind.FORWARD_END, EventKind.EVAL_FORWARD_START, EventKind.EVAL_FORWARD_END,
    EventKind.USER_BACKWARD_START, EventKind.USER_BACKWARD_END, EventKind.STEP, EventKind.TASK_START,
    EventKind.TASK_END, EventKind.OUTPUT_HOOK, EventKind.GRAD_HOOK, EventKind.LEAF_HOOK,
    EventKind.MODULE_PRE_FORWARD, EventKind.MODULE_POST_FORWARD, EventKind.MODULE_PRE_BACKWARD,
    EventKind.MODULE_POST_BACKWARD, EventKind.RECOMPUTE_START, EventKind.RECOMPUTE_END, EventKind.UNPACK,
    EventKind.SAVE_LIVE, EventKind.REREGISTER, EventKind.LEAF_GRAD,
})


@dataclass(frozen=True)
class Event:
    """One event.  Only the fields that matter for its kind are set."""

    kind: EventKind
    param: str | None = None
    module: str | None = None
    task: int | None = None
    value: int | None = None
    phase: str | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value}
        for f in fields(self)[1:]:
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = v
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Event:
        return Event(EventKind(d["kind"]), **{k: v for k, v in d.items() if k != "kind"})

    def __str__(self) -> str:
        parts = [self.kind.value]
        for name in ("module", "param", "phase", "task", "value", "note"):
            v = getattr(self, name)
            if v is not None:
                parts.append(f"{name}={v}")
        return " ".join(parts)


@dataclass(frozen=True)
class Trace:
    """The ordered events of one run, plus the final observable state (per-parameter status etc.)."""

    events: tuple[Event, ...]
    final: Mapping[str, Any] | None = None

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def to_list(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.events]


__all__ = ["DRIVER_EVENTS", "Event", "EventKind", "Trace"]
