"""ZeRO-3's persistent parameters stay gathered while the coordinator's trace drives its releases.

A parameter of at most ``stage3_param_persistence_threshold`` elements is persistent (``ds_persist``): it is
gathered once and kept, trading memory for all-gathers.  Every trace-driven release honours that
(``__params_to_release``, the epilogue's ``release_backward_leftovers``, a recompute owner's attributed
parameters), so once the trace is COMPLETE no module hook of a forward, recompute or backward partitions one.
While the trace is RECORD or INVALID ``release_sub_module`` partitions every parameter of the module,
persistent ones included (docs/coordinator.md), and ``engine.step()`` and a checkpoint's prologue partition
them before gathering them again: neither is judged.
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

from zerostate.model.events import DRIVER_EVENTS, Event, EventKind

from .base import Failure, Spec, fail

_Params: TypeAlias = frozenset[str]


class _Resident(NamedTuple):
    persistent: _Params = frozenset()
    complete: bool = False
    """The coordinator's trace is COMPLETE (the last TRACE_STATE said so)."""
    training: bool = False
    """Between a root forward's start and the next ``engine.step()``: module hooks run."""
    gathering: bool = False
    """Inside the loop's own ``GatheredParameters`` (USER_GATHER): it partitions on exit what it gathered, persistent
    parameters included (partition_parameters.py ``GatheredParameters._exit``) -- not a coordinator release."""
    released: str | None = None
    """A persistent parameter released while COMPLETE, judged at the next driver event: the hook that finds the
    module order changed releases what it prefetched and only then reports the trace INVALID (its cleanup)."""


def _resident_problem(m: _Resident) -> Failure:
    return fail(f"persistent parameter {m.released} was partitioned by a module hook while the trace is COMPLETE "
                "(it is gathered again at its next use: an all-gather per use instead of none)", "persistent-released")


def _resident_step(m: _Resident, ev: Event) -> _Resident | Failure:
    k = ev.kind
    if k is EventKind.PERSISTENT and ev.param is not None:
        return m._replace(persistent=m.persistent | {ev.param})
    if k is EventKind.TRACE_STATE:
        complete = ev.note == "COMPLETE"
        return m if complete == m.complete and m.released is None else m._replace(complete=complete, released=None)
    if k is EventKind.USER_GATHER:
        return m._replace(gathering=ev.note == "enter")
    if k is EventKind.RELEASE:
        if m.complete and m.training and m.released is None and ev.param in m.persistent and not m.gathering:
            return m._replace(released=ev.param)
        return m
    if m.released is not None and k in DRIVER_EVENTS:
        return _resident_problem(m)
    if k in (EventKind.FORWARD_START, EventKind.EVAL_FORWARD_START):
        return m if m.training else m._replace(training=True)
    if k is EventKind.STEP:
        return m._replace(training=False) if m.training else m
    return m


PERSISTENT_RESIDENT = Spec(
    id="persistent-resident",
    sentence=("While the coordinator's trace is COMPLETE, no forward, recompute or backward releases a "
              "persistent parameter."),
    provenance=(("deepspeedai/DeepSpeed#8148 (release_backward_leftovers skips persistent parameters, "
                 "as __params_to_release does)"),
                ("DeepSpeed 0.19.8 release_sub_module: a recompute owner's attributed parameters, persistent ones "
                 "excluded")),
    family="coordinator",
    init=_Resident, step=_resident_step, finish=lambda m: _resident_problem(m) if m.released else None,
    checks=("Folds PERSISTENT, TRACE_STATE, root forward starts and engine.step(): a RELEASE of a persistent "
            "parameter between a root forward's start and the next engine.step() while the last TRACE_STATE "
            "was COMPLETE fails at the next driver event, unless a TRACE_STATE that is not COMPLETE comes first "
            "(the invalidating hook's cleanup of what it prefetched); a RELEASE inside the loop's own "
            "GatheredParameters (USER_GATHER enter .. exit) is the context's, not a hook's."),
    exercised_by=frozenset({EventKind.PERSISTENT}),
    reacts_to=frozenset({EventKind.PERSISTENT, EventKind.TRACE_STATE, EventKind.RELEASE, EventKind.USER_GATHER,
                         *DRIVER_EVENTS}),
)

__all__ = ["PERSISTENT_RESIDENT"]
