"""Specs of the ZeRO-3 parameter coordinator, and its memory metrics.

Monitors read traces only.  A parameter's status is folded from the effect events: FETCH makes it
AVAILABLE, PREFETCH INFLIGHT, RELEASE NOT_AVAILABLE; HOLDERS carries the size of its
``ds_active_sub_modules``; PERSISTENT declares ``ds_persist``.  What a module computes with comes from
its name (`zerostate.model.network.params_of_module`), so a spec needs no network.

When a module *computes*:

* forward, eval and recompute: right after its pre-forward hook (checked at the next driver event);
* backward: right after its pre-backward hook once any recompute it triggers is over (checked at the
  next driver event that is not part of a recompute or an unpack), and again at its post-backward.
  A block recomputed by a *non-reentrant* checkpoint is the exception: its backward reads the tensors
  the recompute saved -- trainable parameters as detached copies taken during the recompute (judged
  when the recompute computed), frozen ones as live references (judged by ``saved-tensor-intact``).
  A recompute is non-reentrant when a module of its block already ran its pre-backward hook in this
  backward (a reentrant block recomputes before any of its backward hooks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, TypeAlias

from zerostate.model.events import DRIVER_EVENTS, Event, EventKind
from zerostate.model.network import Network, params_of_module

from .base import Failure, Metric, Spec, fail
from .persistence_specs import PERSISTENT_RESIDENT

_STATUS = (EventKind.FETCH, EventKind.PREFETCH, EventKind.RELEASE)
_RECOMPUTE_PARTS = frozenset({EventKind.RECOMPUTE_START, EventKind.MODULE_PRE_FORWARD, EventKind.MODULE_POST_FORWARD,
                              EventKind.SAVE_LIVE, EventKind.RECOMPUTE_END, EventKind.UNPACK})
_ROOT_FORWARDS = (EventKind.FORWARD_START, EventKind.EVAL_FORWARD_START)


_Params: TypeAlias = frozenset[str]
_StatusSets: TypeAlias = tuple[_Params, _Params]
"""(AVAILABLE, INFLIGHT) parameter names."""


def _param(ev: Event) -> str:
    """The parameter a status, unpack or holders event names (every such event names one)."""
    assert ev.param is not None, f"a {ev.kind.value} event names its parameter"
    return ev.param


def _module(ev: Event) -> str:
    """The module a module hook event names (every such event names one)."""
    assert ev.module is not None, f"a {ev.kind.value} event names its module"
    return ev.module


def _status(avail: _Params, inflight: _Params, ev: Event) -> _StatusSets:
    """Fold one status event into (AVAILABLE, INFLIGHT) parameter sets.

    Three specs fold the same status events from the same initial sets, so the result for the last
    (avail, inflight, event) -- compared by identity -- is kept and handed to the next spec as is: they then
    share one pair of sets, and a ZeRO-3 job's ~100-parameter AVAILABLE set is copied once per event, not
    once per spec.  (A pure function's cache: a miss only recomputes.)"""
    last = _LAST_STATUS[0]
    if last is not None and last[0] is ev and last[1] is avail and last[2] is inflight:
        return last[3]
    p = _param(ev)
    if ev.kind is EventKind.FETCH:  # the same sets (no copy) where nothing changes
        out = (avail if p in avail else avail | {p}), (inflight - {p} if p in inflight else inflight)
    elif ev.kind is EventKind.PREFETCH:
        out = (avail - {p} if p in avail else avail), (inflight if p in inflight else inflight | {p})
    else:
        out = (avail - {p} if p in avail else avail), (inflight - {p} if p in inflight else inflight)
    _LAST_STATUS[0] = (ev, avail, inflight, out)
    return out


_LAST_STATUS: list[tuple[Event, _Params, _Params, _StatusSets] | None] = [None]
_EMPTY: _Params = frozenset()
"""The one empty set the status-folding specs start from (so `_status`'s cache sees the same objects)."""


def _block_of(module: str | None) -> str | None:
    if not module or not module.startswith("blocks."):
        return None
    return ".".join(module.split(".")[:2])


def _block_regions(module: str | None) -> tuple[str, ...]:
    """The checkpointed region a module of zerostate's network belongs to: its block (``blocks.<i>``)."""
    b = _block_of(module)
    return (b,) if b else ()


def ancestor_regions(module: str | None) -> tuple[str, ...]:
    """Every dotted prefix of ``module`` and itself (``a``, ``a.b``, ``a.b.c``): the regions a user's module may
    be recomputed in, whichever of its ancestors a checkpoint wraps (``zerostate watch``)."""
    if not module:
        return ()
    parts = module.split(".")
    return tuple(".".join(parts[:i]) for i in range(1, len(parts) + 1))


# ---------------------------------------------------------- available-when-used
class _Used(NamedTuple):
    avail: _Params = _EMPTY
    inflight: _Params = _EMPTY
    fwd: tuple[str, str | None] | None = None
    """(module, phase) whose forward computes at the next driver event."""
    bwd: str | None = None
    """Module whose backward computes at the next driver event outside a recompute / unpack."""
    pre_bwd: frozenset[str] = frozenset()
    """Regions (blocks) with a module whose pre-backward hook ran in this backward."""
    nonreentrant: frozenset[str] = frozenset()
    """Regions (blocks) recomputed by a non-reentrant checkpoint in this backward."""


def _used_fail(module: str, what: str, missing: list[str]) -> Failure:
    return fail(f"{module} computes ({what}) with {', '.join(missing)} not AVAILABLE (partitioned or still "
                "in flight): the module would read an empty or incomplete parameter",
                f"unavailable-in-{what.split()[0]}")


UsedStep: TypeAlias = Callable[[_Used, Event], _Used | Failure]


def used_step(params_of: Callable[[str], Iterable[str]] = params_of_module,
              regions_of: Callable[[str | None], tuple[str, ...]] = _block_regions) -> UsedStep:
    """The ``available-when-used`` monitor step for a model whose module -> parameters map is ``params_of``
    (what ZeRO-3 fetches for the module) and whose modules lie in the checkpointed regions ``regions_of``
    (a RECOMPUTE_START names its region).  Defaults: zerostate's network (`params_of_module`, blocks)."""

    def missing(module: str, avail: _Params) -> list[str]:
        return [p for p in params_of(module) if p not in avail]

    def exempt(module: str, nonreentrant: frozenset[str]) -> bool:
        return bool(nonreentrant) and any(r in nonreentrant for r in regions_of(module))

    def step(m: _Used, ev: Event) -> _Used | Failure:
        k = ev.kind
        if k in _STATUS:
            a, i = _status(m.avail, m.inflight, ev)
            return m if a is m.avail and i is m.inflight else _Used(a, i, *m[2:])
        if k not in DRIVER_EVENTS:
            return m
        if m.fwd is not None:  # the module whose pre-forward hook just ran computes now
            miss = missing(m.fwd[0], m.avail)
            if miss:
                return _used_fail(m.fwd[0], m.fwd[1] or "forward", miss)
            m = _Used(m.avail, m.inflight, None, *m[3:])  # (positional: this runs per module hook)
        bwd = m.bwd
        if bwd is not None and k not in _RECOMPUTE_PARTS:
            if not exempt(bwd, m.nonreentrant):
                miss = missing(bwd, m.avail)
                if miss:
                    return _used_fail(bwd, "backward", miss)
            m = _Used(m.avail, m.inflight, m.fwd, None, m.pre_bwd, m.nonreentrant)
        if k is EventKind.USER_BACKWARD_START:
            return m._replace(pre_bwd=frozenset(), nonreentrant=frozenset())
        if k is EventKind.MODULE_PRE_FORWARD:
            return _Used(m.avail, m.inflight, (_module(ev), ev.phase), *m[3:])
        if k is EventKind.MODULE_PRE_BACKWARD:
            rs = regions_of(ev.module)
            return _Used(m.avail, m.inflight, m.fwd, _module(ev), m.pre_bwd.union(rs) if rs else m.pre_bwd,
                         m.nonreentrant)
        if k is EventKind.RECOMPUTE_START and ev.module is not None and ev.module in m.pre_bwd:
            return m._replace(nonreentrant=m.nonreentrant | {ev.module})
        if k is EventKind.MODULE_POST_BACKWARD:
            module = _module(ev)
            if not exempt(module, m.nonreentrant):
                miss = missing(module, m.avail)
                if miss:
                    return _used_fail(module, "backward", miss)
        return m

    return step


_used_step = used_step()


def available_when_used(params_of: Callable[[str], Iterable[str]] = params_of_module,
                        regions_of: Callable[[str | None], tuple[str, ...]] = _block_regions) -> Spec:
    """``available-when-used`` with `used_step` (``params_of``, ``regions_of``); the defaults give the spec
    zerostate's own network is judged on, ``zerostate watch`` passes the user's model."""
    return Spec(
        id="available-when-used",
        sentence="Whenever a module computes (forward, recompute, backward), all its parameters are AVAILABLE.",
        provenance=("DeepSpeed parameter_offload.py pre_sub_module_forward/backward_function",
                    "partitioned_param_coordinator.py fetch_sub_module (assert ds_status == AVAILABLE)"),
        family="coordinator",
        init=_Used, step=used_step(params_of, regions_of), finish=lambda m: None,
        checks=("After every MODULE_PRE_FORWARD (any phase) the module's parameters are AVAILABLE at the next "
                "driver event; after every MODULE_PRE_BACKWARD they are AVAILABLE at the next driver event outside "
                "a recompute/unpack and at the module's MODULE_POST_BACKWARD -- except in blocks recomputed by a "
                "non-reentrant checkpoint, whose backward reads the recompute's saved tensors."),
        exercised_by=frozenset({EventKind.MODULE_PRE_FORWARD}),
        reacts_to=frozenset({*_STATUS, *DRIVER_EVENTS}),
    )


AVAILABLE_WHEN_USED = available_when_used()


# ---------------------------------------------------------- saved-tensor-intact
class _Saved(NamedTuple):
    avail: _Params = _EMPTY
    inflight: _Params = _EMPTY
    live: _Params = frozenset()
    """Parameters a non-reentrant recompute saved as live references, not yet unpacked for use."""
    partitioned: _Params = frozenset()
    """Live-saved parameters partitioned since they were saved (for the message)."""


def _saved_step(m: _Saved, ev: Event) -> _Saved | Failure:
    k = ev.kind
    if k in _STATUS:
        a, i = _status(m.avail, m.inflight, ev)
        part = m.partitioned | {_param(ev)} if k is EventKind.RELEASE and ev.param in m.live else m.partitioned
        return m if a is m.avail and i is m.inflight and part is m.partitioned else _Saved(a, i, m.live, part)
    if k is EventKind.SAVE_LIVE:
        p = _param(ev)
        return m._replace(live=m.live | {p}, partitioned=m.partitioned - {p})
    if k is EventKind.UNPACK:
        p = _param(ev)
        if p not in m.avail:
            where = ("torch.utils.checkpoint.CheckpointError: recomputed values have different metadata "
                     f"({p}: saved with its full shape, recomputed shape [0])" if ev.note == "check" else
                     f"the backward of {ev.module} reads {p} through its live saved reference and finds "
                     "shape [0]")
            how = ("partitioned in place after the recompute saved it" if p in m.partitioned
                   else "not gathered when unpacked")
            return fail(f"{p} is {how}: {where}", ("partitioned" if p in m.partitioned else "not-gathered")
                        + ("-at-check" if ev.note == "check" else "-at-use"))
        if ev.note == "use":
            return m._replace(live=m.live - {p}, partitioned=m.partitioned - {p})
    return m


SAVED_TENSOR_INTACT = Spec(
    id="saved-tensor-intact",
    sentence=("A parameter referenced by a live saved checkpoint tensor is whole whenever that tensor is "
              "unpacked: never partitioned since it was saved, or gathered again in place before the unpack."),
    provenance=("seed 002", "deepspeedai/DeepSpeed#8130", "deepspeedai/DeepSpeed#8148",
                "torch/utils/checkpoint.py (x.detach() if x.requires_grad else x; check_recomputed_tensors_match)"),
    family="coordinator",
    init=_Saved, step=_saved_step, finish=lambda m: None,
    checks=("At every UNPACK (note=check: torch's metadata check right after the recompute; note=use: the "
            "module's backward) of a parameter, that parameter is AVAILABLE.  ZeRO-3 swaps param.data in place, "
            "so a live reference sees whatever param.data is at unpack time: a release in between is harmless "
            "if a fetch re-gathered it before the unpack (0.19.3 does), fatal otherwise (0.19.2: CheckpointError)."),
    exercised_by=frozenset({EventKind.UNPACK}),
    reacts_to=frozenset({*_STATUS, EventKind.SAVE_LIVE, EventKind.UNPACK}),
)


# ------------------------------------------------------- released-after-backward
class _Released(NamedTuple):
    avail: _Params = _EMPTY
    inflight: _Params = _EMPTY
    held: _Params = frozenset()
    """Parameters with at least one holder (HOLDERS value > 0)."""
    persistent: _Params = frozenset()
    pending: bool = False
    """A user backward returned; judge at the next driver event (its epilogue has run by then)."""


def _released_problem(m: _Released) -> Failure | None:
    leaked = sorted((m.avail | m.inflight) - m.persistent)
    if leaked:
        return fail(f"after the backward (and its epilogue) {', '.join(leaked)} "
                    f"{'is' if len(leaked) == 1 else 'are'} still gathered: leaked until engine.step() or beyond",
                    "still-gathered")
    held = sorted(m.held)
    if held:
        return fail(f"after the backward {', '.join(held)} still {'has' if len(held) == 1 else 'have'} holders "
                    "(ds_active_sub_modules not empty): stale bookkeeping", "stale-holders")
    return None


def _released_step(m: _Released, ev: Event) -> _Released | Failure:
    k = ev.kind
    if k in _STATUS:
        a, i = _status(m.avail, m.inflight, ev)
        return m if a is m.avail and i is m.inflight else _Released(a, i, *m[2:])
    if k is EventKind.HOLDERS:
        p = _param(ev)
        if (ev.value or 0) > 0:
            return m if p in m.held else _Released(m.avail, m.inflight, m.held | {p}, m.persistent, m.pending)
        return _Released(m.avail, m.inflight, m.held - {p}, m.persistent, m.pending) if p in m.held else m
    if k is EventKind.PERSISTENT:
        return m._replace(persistent=m.persistent | {_param(ev)})
    if k is EventKind.USER_BACKWARD_END:
        return m._replace(pending=True)
    if m.pending and k in DRIVER_EVENTS:
        failed = _released_problem(m)
        return failed if failed else m._replace(pending=False)
    return m


RELEASED_AFTER_BACKWARD = Spec(
    id="released-after-backward",
    sentence=("When a backward completes, every non-persistent parameter is NOT_AVAILABLE and held by no "
              "module; nothing leaks across steps."),
    provenance=("deepspeedai/DeepSpeed#8148 (release_backward_leftovers; lifecycle tests)", "seed 002"),
    family="coordinator",
    init=_Released, step=_released_step,
    finish=lambda m: _released_problem(m) if m.pending else None,
    checks=("At the first driver event after each USER_BACKWARD_END (or the end of the run) -- so after the "
            "epilogue -- no non-persistent parameter is AVAILABLE or INFLIGHT and no parameter has holders."),
    exercised_by=frozenset({EventKind.USER_BACKWARD_END}),
    reacts_to=frozenset({*_STATUS, EventKind.HOLDERS, EventKind.PERSISTENT, *DRIVER_EVENTS}),
)


# ----------------------------------------------------------------- trace-consistent
_Modules: TypeAlias = tuple[str | None, ...]


class _TraceMon(NamedTuple):
    mode: str = "INVALID"
    order: _Modules = ()
    pos: int = 0
    expect: tuple[str, ...] = ()
    """TRACE_STATE notes the current driver event must produce, in order."""
    why: str = ""
    inflight: _Params = frozenset()
    invalidated: bool = False
    """An invalidation happened at the current driver event (judge the leftovers at the next one)."""
    active: bool = False
    """The trace reports the coordinator's trace mode (a TRACE_STATE was seen).  ZeRO-1/2 traces, and
    traces that do not report it, are not judged."""
    owed: tuple[_Modules, int] | tuple[()] = ()
    """(recorded order, position) of a COMPLETE trace invalidated before any traced module deviated: the
    next module hook must deviate there.  DeepSpeed also fetches (and so traces) container modules the
    event vocabulary does not carry (a ``Block`` holding ``norm`` and ``lin``); a branch that skips
    ``blocks.0.norm`` invalidates at the ``blocks.1`` container's hook, one hook before ``blocks.1.norm``."""


def _container_pre_hook(ev: Event) -> bool:
    """A ``Block`` container's pre-forward / pre-backward hook (CONTAINER_HOOK, where the trace reports
    them): DeepSpeed's trace protocol counts it like any module's."""
    return ev.kind is EventKind.CONTAINER_HOOK and ev.note in ("pre_forward", "pre_backward")


def _trace_expectations(m: _TraceMon, ev: Event) -> _TraceMon | Failure:
    k = ev.kind
    if k in _ROOT_FORWARDS:
        if m.mode == "RECORD":
            return m._replace(expect=("COMPLETE",), why="a root forward after a recorded pass", pos=0)
        if m.mode == "INVALID":
            return m._replace(expect=("RECORD",), why="a root forward with no valid trace", pos=0, order=())
        return m._replace(pos=0)
    if k is EventKind.REREGISTER:
        if m.mode != "INVALID":
            return m._replace(expect=("INVALID",), why="hooks re-registered")
        return m
    if k in (EventKind.MODULE_PRE_FORWARD, EventKind.MODULE_PRE_BACKWARD) or _container_pre_hook(ev):
        if m.owed:
            order, pos = m.owed
            if pos < len(order) and order[pos] == ev.module:
                return fail("the trace became INVALID though the module order did not call for it",
                            "uncalled-for-invalid")
            return m._replace(owed=(), pos=m.pos + 1)
        if m.mode == "COMPLETE":
            if m.pos >= len(m.order):
                return m._replace(expect=("INVALID",), pos=m.pos + 1,
                                  why=f"{ev.module} at step {m.pos} is past the trace's {len(m.order)} modules")
            if m.order[m.pos] != ev.module:
                return m._replace(expect=("INVALID",), pos=m.pos + 1,
                                  why=f"{ev.module} at step {m.pos}, where the trace recorded {m.order[m.pos]}")
        elif m.mode == "RECORD":
            return m._replace(order=m.order + (ev.module,), pos=m.pos + 1)
        return _TraceMon(m.mode, m.order, m.pos + 1, *m[3:])  # (positional: this runs per module hook)
    return m


def _trace_step(m: _TraceMon, ev: Event) -> _TraceMon | Failure:
    k = ev.kind
    if k is EventKind.TRACE_STATE and not m.active:
        m = m._replace(active=True)
    if k is EventKind.PREFETCH:
        if m.mode != "COMPLETE" and m.active:
            return fail(f"{ev.param} prefetched while the trace is {m.mode}: a prefetch from a stale trace",
                        "prefetch-from-stale-trace")
        return m._replace(inflight=m.inflight | {_param(ev)})
    if k in (EventKind.FETCH, EventKind.RELEASE):
        return m._replace(inflight=m.inflight - {ev.param}) if ev.param in m.inflight else m
    if k is EventKind.TRACE_STATE:
        if not m.expect and ev.note == "INVALID" and m.mode == "COMPLETE" and not m.owed:
            # possibly called for by an untraced container module: the next module hook must show it
            return m._replace(mode="INVALID", owed=(m.order, m.pos), order=(), invalidated=True)
        if not m.expect or m.expect[0] != ev.note:
            return fail(f"the trace became {ev.note} though the module order did not call for it",
                        f"uncalled-for-{str(ev.note).lower()}")
        new = m._replace(mode=m.expect[0], expect=m.expect[1:])  # the note, as expected
        if ev.note == "INVALID":
            new = new._replace(order=(), invalidated=True)
        return new
    if k not in DRIVER_EVENTS and k is not EventKind.CONTAINER_HOOK:
        return m
    if m.owed and k not in (EventKind.MODULE_PRE_FORWARD, EventKind.MODULE_PRE_BACKWARD, EventKind.MODULE_POST_FORWARD,
                            EventKind.MODULE_POST_BACKWARD, EventKind.CONTAINER_HOOK):
        return fail("the trace became INVALID though the module order did not call for it", "uncalled-for-invalid")
    if m.expect and m.active:
        return fail(f"the trace was not made {m.expect[0]} after {m.why}", f"not-made-{str(m.expect[0]).lower()}")
    if m.invalidated:
        if m.inflight:
            return fail(f"the invalidated trace left {', '.join(sorted(m.inflight))} in flight", "left-in-flight")
        m = m._replace(invalidated=False)
    return _trace_expectations(m, ev)


def _trace_finish(m: _TraceMon) -> Failure | None:
    if m.expect and m.active:
        return fail(f"the trace was not made {m.expect[0]} after {m.why}", f"not-made-{str(m.expect[0]).lower()}")
    if m.owed:
        return fail("the trace became INVALID though the module order did not call for it", "uncalled-for-invalid")
    return None


TRACE_CONSISTENT = Spec(
    id="trace-consistent",
    sentence=("The trace is invalidated exactly when the module order differs from the recorded one (or hooks "
              "are re-registered), and an invalidated trace leaves no stale bookkeeping behind."),
    provenance=("DeepSpeed partitioned_param_coordinator.py trace_prologue / _invalidate_trace / reset_step",
                "parameter_offload.py _register_deepspeed_module (re-registration invalidates)"),
    family="coordinator",
    init=_TraceMon, step=_trace_step, finish=_trace_finish,
    checks=("Replays the protocol from the module hooks alone: a root forward turns RECORD into COMPLETE and "
            "INVALID into RECORD; with a COMPLETE trace the k-th module hook of a pass must be the k-th recorded "
            "one, else INVALID; REREGISTER invalidates.  The TRACE_STATE events must be exactly these, except that "
            "an INVALID may come one untraced (container) module hook early: then the next traced module hook "
            "must deviate from the recorded order.  After an "
            "invalidation nothing stays INFLIGHT and nothing is PREFETCHed until a trace is COMPLETE again.  "
            "Traces that never report a TRACE_STATE (ZeRO-1/2; a tracer that does not record the mode) are not "
            "judged."),
    exercised_by=frozenset({EventKind.TRACE_STATE}),
    reacts_to=frozenset({*_STATUS, EventKind.TRACE_STATE, EventKind.CONTAINER_HOOK, *DRIVER_EVENTS}),
)


# --------------------------------------------------------------------- metrics
def _numel(net: Network, p: str) -> int:
    return net.params[p].numel if p in net.params else 0


def gathered_peak(events: Iterable[Event], net: Network) -> float:
    """Largest number of parameter elements AVAILABLE or INFLIGHT at once over the run."""
    gathered: set[str] = set()
    total = peak = 0
    for ev in events:
        if ev.kind in (EventKind.FETCH, EventKind.PREFETCH):
            p = _param(ev)
            if p not in gathered:
                gathered.add(p)
                total += _numel(net, p)
                peak = max(peak, total)
        elif ev.kind is EventKind.RELEASE:
            p = _param(ev)
            if p in gathered:
                gathered.discard(p)
                total -= _numel(net, p)
    return float(peak)


def allgathers(events: Iterable[Event], net: Network) -> float:
    """Parameters all-gathered over the run (a fetch that waited on a prefetch is not a new one)."""
    return float(sum(1 for ev in events
                     if ev.kind is EventKind.PREFETCH or (ev.kind is EventKind.FETCH and ev.note != "inflight")))


GATHERED_PEAK = Metric(
    id="gathered-peak",
    sentence="The largest number of parameter elements AVAILABLE or INFLIGHT at once.",
    provenance=("seed 002 (the two fixes differ in how long parameters stay gathered)",),
    measure=gathered_peak,
)

ALLGATHERS = Metric(
    id="allgathers",
    sentence="How many parameters were all-gathered (fetched or prefetched) over the run.",
    provenance=("seed 002",),
    measure=allgathers,
)

COORDINATOR_SPECS = (AVAILABLE_WHEN_USED, SAVED_TENSOR_INTACT, RELEASED_AFTER_BACKWARD, TRACE_CONSISTENT,
                     PERSISTENT_RESIDENT)
COORDINATOR_METRICS = (GATHERED_PEAK, ALLGATHERS)

__all__ = ["ALLGATHERS", "AVAILABLE_WHEN_USED", "COORDINATOR_METRICS", "COORDINATOR_SPECS", "GATHERED_PEAK",
           "PERSISTENT_RESIDENT", "RELEASED_AFTER_BACKWARD", "SAVED_TENSOR_INTACT", "TRACE_CONSISTENT", "allgathers",
           "ancestor_regions", "available_when_used", "gathered_peak", "used_step"]
