"""Model agreement: does the model design of a release predict what real DeepSpeed did?

The model's trace and the real trace differ in detail that neither side controls
(where a graph task's start is first *seen*, hook order inside a phase, module
events that only ZeRO-3 has).  So both are *projected* onto what is robustly
observable, and only the projections are compared:

* per user backward (``USER_BACKWARD_START`` up to the next forward, eval forward,
  ``engine.step()`` or end of run): how many epilogues ran; whether a gradient or
  leaf hook fired after the first epilogue (a premature epilogue); how many times
  ``count_used_parameters_in_backward`` was evaluated; and the set of parameters
  whose gradient was handled (``BUCKET_ADD``);
* per forward: how many ``COUNT`` and ``EPILOGUE`` events happened inside it (a
  backward made inside forward, the fused head);
* whether stale bucket entries were cleared at each ``engine.step()``.

The coordinator half (ZeRO-3) is projected per parameter: each FETCH / PREFETCH /
RELEASE and the parameter's holder count (``ds_active_sub_modules``) at the end of every module
hook where it changed, each anchored at the module hook (or schedule mark) it happened in
(`coordinator_project`).  A wrong coordinator design -- what a recompute releases, what the trace
keeps for reuse, what persistence exempts, what prefetch gathers ahead under
``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters`` -- differs there.  The model's
``Block`` containers (``CONTAINER_HOOK``, which DeepSpeed hooks, traces and prefetches in like any
module) are never anchors: what happens in one is anchored at the module hook before it on both
sides (traces that do not report containers, e.g. ``zerostate watch``'s, compare the same way).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zerostate.model.events import EventKind, Event

_CLOSERS = (EventKind.FORWARD_START, EventKind.EVAL_FORWARD_START, EventKind.STEP)


def project(events: Iterable[Event]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    cur: dict[str, Any] | None = None
    fwd: dict[str, Any] | None = None
    n_bwd = n_fwd = n_step = 0

    def close() -> None:
        nonlocal cur
        if cur is not None:
            cur["handled"] = sorted(cur["handled"])
            out.append((cur.pop("where"), cur))
            cur = None

    for e in events:
        k = e.kind
        if k in _CLOSERS:
            close()
        if k is EventKind.FORWARD_START:
            fwd = {"where": f"forward #{n_fwd}", "counts": 0, "epilogues": 0}
            n_fwd += 1
        elif k is EventKind.FORWARD_END and fwd is not None:
            out.append((fwd.pop("where"), fwd))
            fwd = None
        elif k is EventKind.USER_BACKWARD_START:
            close()
            cur = {"where": f"user backward #{n_bwd} ({e.note})", "epilogues": 0, "late_hook": False,
                   "counts": 0, "handled": set()}
            n_bwd += 1
        elif k is EventKind.STEP:
            out.append((f"engine.step() #{n_step}", {"stale_cleared": False}))
            n_step += 1
        elif k is EventKind.BUCKET_CLEAR and out and out[-1][0].startswith("engine.step()"):
            out[-1][1]["stale_cleared"] = bool(e.value)
        target = fwd if fwd is not None else cur
        if target is None:
            continue
        if k is EventKind.EPILOGUE:
            target["epilogues"] += 1
        elif k is EventKind.COUNT:
            target["counts"] += 1
        elif target is cur and k in (EventKind.GRAD_HOOK, EventKind.LEAF_HOOK) and cur["epilogues"]:
            cur["late_hook"] = True
        elif target is cur and k is EventKind.BUCKET_ADD:
            cur["handled"].add(e.param)
    close()
    return out


_MOD = (EventKind.MODULE_PRE_FORWARD, EventKind.MODULE_POST_FORWARD,
        EventKind.MODULE_PRE_BACKWARD, EventKind.MODULE_POST_BACKWARD)
_MARKS = (EventKind.USER_BACKWARD_START, EventKind.STEP, EventKind.FORWARD_START,
          EventKind.EVAL_FORWARD_START, EventKind.EPILOGUE)
_PARAM = (EventKind.FETCH, EventKind.PREFETCH, EventKind.RELEASE)


_FORWARD_STARTS = (EventKind.FORWARD_START.value, EventKind.EVAL_FORWARD_START.value)
_STATUS_AFTER = {EventKind.FETCH: "AVAILABLE", EventKind.PREFETCH: "INFLIGHT", EventKind.RELEASE: "NOT_AVAILABLE"}


def coordinator_project(events: Iterable[Event], params: Iterable[str] | None = None,
                        holders: bool = True) -> dict[str, list[tuple[str | int | None, ...]]]:
    """Per parameter: ``(fetch | prefetch | release, anchor)`` in order, anchor = the last module hook
    (``module_post_backward:blocks.0.norm:``) or schedule mark before it, and with ``holders`` the
    holder count at the end of each anchor where it changed.

    What is compared is each parameter's *net* status change over an anchor (NOT_AVAILABLE ->
    AVAILABLE: fetch, -> INFLIGHT: prefetch, -> NOT_AVAILABLE: release; an in-flight gather completing
    is left out), because that is all the tracer can see: it polls statuses after each hook, so a
    release and a fetch again inside one hook (an invalidated trace's in-flight cleanup, then the
    module's own fetch) reach it as no change or as an in-flight gather completing.  For the same reason a
    forward start and the root module's pre-forward hook are one anchor: ``reset_step`` (which waits and
    releases what is still in flight) runs in the root's first forward pre-hook, before its pre-forward
    fetch, and the tracer polls statuses only after that.
    ``params``: the parameters to project (default: every one the events name)."""
    events = list(events)
    if params is None:
        params = sorted({e.param for e in events if e.param and e.kind in (*_PARAM, EventKind.HOLDERS)})
    params = list(params)
    out: dict[str, list[tuple[str | int | None, ...]]] = {p: [] for p in params}
    count: dict[str, int | None] = dict.fromkeys(params, 0)
    shown = dict(count)
    status = dict.fromkeys(params, "NOT_AVAILABLE")
    before = dict(status)
    anchor = "start"

    def flush() -> None:
        for p in params:
            was, now = before[p], status[p]
            if was != now and not (was == "INFLIGHT" and now == "AVAILABLE"):
                kind = "release" if now == "NOT_AVAILABLE" else "prefetch" if now == "INFLIGHT" else "fetch"
                out[p].append((kind, anchor))
            before[p] = now
            if holders and count[p] != shown[p]:
                out[p].append(("holders", count[p], anchor))
                shown[p] = count[p]

    for e in events:
        if e.kind in _MOD or e.kind in _MARKS:
            if not (e.kind is EventKind.MODULE_PRE_FORWARD and anchor in _FORWARD_STARTS):
                flush()
            anchor = f"{e.kind.value}:{e.module}:{e.phase or ''}" if e.kind in _MOD else e.kind.value
        elif e.kind in _PARAM and e.param in out:
            status[e.param] = _STATUS_AFTER[e.kind]
        elif e.kind is EventKind.HOLDERS and e.param in out:
            count[e.param] = e.value
    flush()
    return out


def compare_coordinator(model_events: Iterable[Event], real_events: Iterable[Event], design: str) -> str | None:
    """None when the coordinator projections agree."""
    model_events, real_events = list(model_events), list(real_events)
    if not any(e.kind in _MOD for e in real_events):
        return None  # ZeRO-1/2: no coordinator
    m, r = coordinator_project(model_events), coordinator_project(real_events)
    for p in sorted(m.keys() | r.keys()):
        mv, rv = m.get(p, []), r.get(p, [])
        if mv == rv:
            continue
        i = next((k for k, (a, b) in enumerate(zip(mv, rv, strict=False)) if a != b), min(len(mv), len(rv)))
        got = rv[i] if i < len(rv) else "nothing more"
        want = mv[i] if i < len(mv) else "nothing more"
        return (f"coordinator: {p}, event {i}: real DeepSpeed {got!r} but the model design {design} "
                f"predicts {want!r}")
    return None


def compare(model_events: Iterable[Event], real_events: Iterable[Event], design: str) -> str | None:
    """None when the projections agree; else a sentence naming the first difference (hook half first,
    then the coordinator half)."""
    model_events, real_events = list(model_events), list(real_events)
    m, r = project(model_events), project(real_events)
    for (mw, mv), (rw, rv) in zip(m, r, strict=False):
        if mw != rw:
            return f"the schedules differ at {rw!r} (model: {mw!r})"
        for key in mv:
            if mv[key] != rv.get(key):
                return (f"{rw}: {key} is {rv.get(key)!r} in real DeepSpeed but the model design "
                        f"{design} predicts {mv[key]!r}")
    if len(m) != len(r):
        return f"the real trace has {len(r)} observable sections, the model {len(m)}"
    return compare_coordinator(model_events, real_events, design)


__all__ = ["compare", "compare_coordinator", "coordinator_project", "project"]
