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

Parameter-coordinator events (FETCH / RELEASE per phase) are not compared yet:
they are judged by the coordinator specs on the real trace instead.
"""

from __future__ import annotations

from typing import Any, Iterable

from zerostate.model.events import Ev, Event

_CLOSERS = (Ev.FORWARD_START, Ev.EVAL_FORWARD_START, Ev.STEP)


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
        if k is Ev.FORWARD_START:
            fwd = {"where": f"forward #{n_fwd}", "counts": 0, "epilogues": 0}
            n_fwd += 1
        elif k is Ev.FORWARD_END and fwd is not None:
            out.append((fwd.pop("where"), fwd))
            fwd = None
        elif k is Ev.USER_BACKWARD_START:
            close()
            cur = {"where": f"user backward #{n_bwd} ({e.note})", "epilogues": 0, "late_hook": False,
                   "counts": 0, "handled": set()}
            n_bwd += 1
        elif k is Ev.STEP:
            out.append((f"engine.step() #{n_step}", {"stale_cleared": False}))
            n_step += 1
        elif k is Ev.BUCKET_CLEAR and out and out[-1][0].startswith("engine.step()"):
            out[-1][1]["stale_cleared"] = bool(e.value)
        target = fwd if fwd is not None else cur
        if target is None:
            continue
        if k is Ev.EPILOGUE:
            target["epilogues"] += 1
        elif k is Ev.COUNT:
            target["counts"] += 1
        elif target is cur and k in (Ev.GRAD_HOOK, Ev.LEAF_HOOK) and cur["epilogues"]:
            cur["late_hook"] = True
        elif target is cur and k is Ev.BUCKET_ADD:
            cur["handled"].add(e.param)
    close()
    return out


def compare(model_events: Iterable[Event], real_events: Iterable[Event], design: str) -> str | None:
    """None when the projections agree; else a sentence naming the first difference."""
    m, r = project(model_events), project(real_events)
    for (mw, mv), (rw, rv) in zip(m, r):
        if mw != rw:
            return f"the schedules differ at {rw!r} (model: {mw!r})"
        for key in mv:
            if mv[key] != rv.get(key):
                return (f"{rw}: {key} is {rv.get(key)!r} in real DeepSpeed but the model design "
                        f"{design} predicts {mv[key]!r}")
    if len(m) != len(r):
        return f"the real trace has {len(r)} observable sections, the model {len(m)}"
    return None


__all__ = ["compare", "project"]
