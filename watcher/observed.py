"""What the watch observed of a job, and what it did not: said loudly, apart from the findings about DeepSpeed.

`problems` are the watch's own failures to observe -- no engine watched (with the likely cause, read from
the processes' records, `zerostate.watcher.process`), a rank that ended before its events were checked, a
``--runtime`` that did not install, the watch failing itself -- and make ``zerostate watch`` exit non-zero
even when the job exited 0.  `not_checked` names the parts of a watched job the specs could not judge
(a reentrant checkpoint's recompute).  `configuration` says what the job ran (checkpointing as the trainer
left it).  `crashes` are the exceptions that ended a process outside DeepSpeed's engine calls.
"""

from __future__ import annotations

from typing import Any

NO_ENGINE = "no DeepSpeed engine was watched"


def _no_engine_cause(processes: list[dict[str, Any]], exit_status: int | None) -> str:
    """The likely reason no engine was watched, from what each Python process of the command recorded."""
    if not processes:
        return ("no Python process of the command ran zerostate's sitecustomize (the command is not a Python job, "
                "or its launcher replaced PYTHONPATH)")
    imported = [p for p in processes if p.get("deepspeed")]
    ends = [(p, p.get("crash") or (p.get("exit") if exit_status else None)) for p in processes]
    crashed = sorted(((p, c) for p, c in ends if c), key=lambda pc: pc[1].get("time", 0.0))
    crash = ""
    if crashed:
        c = crashed[0][1]
        crash = f"; rank {c['rank']} (pid {crashed[0][0]['pid']}) died first, of {c['type']}: {c['message'][:200]}"
    errors = [e for p in processes for e in p.get("watch_errors", [])]
    if errors:
        return f"the watch failed: {errors[0]}"
    skipped = [s for p in processes for s in p.get("skipped", [])]
    if skipped:
        return f"deepspeed.initialize built only engines the watch does not judge: {skipped[0]}"
    if not imported:
        return (f"none of the {len(processes)} Python process(es) of the command imported deepspeed" + crash
                + ("" if crash or exit_status else " (is this a DeepSpeed job?)"))
    return ("deepspeed was imported but deepspeed.initialize never built an engine" + crash
            + ("" if crash else " (the job ended before training, or builds its engine another way)"))


def problems(engines: list[dict[str, Any]], processes: list[dict[str, Any]], status: str,
             exit_status: int | None, runtime: bool) -> list[str]:
    """The watch's own failures to observe, each a sentence (empty: everything the job ran was watched)."""
    out: list[str] = []
    if status == "running":
        return out
    if not engines:
        out.append(f"{NO_ENGINE}: {_no_engine_cause(processes, exit_status)}")
    for e in engines:
        if not e.get("closed") and status == "complete":
            out.append(f"rank {e['rank']} (pid {e.get('pid')}) ended without closing its watch (killed?): its last "
                       "events (up to 255) and its end-of-run obligations were not checked")
    if exit_status not in (None, 0) and engines and not crashes(engines, processes, exit_status) \
            and not any(e.get("broken_in") for e in engines):
        out.append(f"the job failed (exit status {exit_status}) but no process recorded why: no exception escaped "
                   "to sys.excepthook or sys.exit (killed by a signal, os._exit, SystemExit raised directly, or a "
                   "native crash)")
    for p in processes:
        for err in p.get("watch_errors", []) if engines else ():
            out.append(f"pid {p['pid']}: {err}")
    if runtime:
        reasons = sorted({r for p in processes for r in p.get("runtime_errors", [])})
        stock = [e for e in engines if not e.get("runtime_installed")]
        if stock or (reasons and not engines):
            where = ", ".join(f"rank {e['rank']}" for e in stock) or "the job"
            out.append(f"--runtime: zerostate.runtime was not installed in {where}: "
                       + ("; ".join(reasons) or "no reason was logged (the engine is not a ZeRO engine?)"))
    return out


def not_checked(engines: list[dict[str, Any]]) -> list[str]:
    """Parts of the watched job the specs could not judge."""
    out = []
    reentrant = sum(e.get("checkpointing", {}).get("reentrant_module_recomputes", 0) for e in engines)
    if reentrant:
        out.append(f"reentrant checkpoint recompute ({reentrant} module forwards re-run inside a backward): torch "
                   "re-runs the forward under a nested backward and keeps what it saves to itself, so "
                   "`saved-tensor-intact` was not checked there (the module hooks were, as phase `recompute`)")
    return out


def configuration(engines: list[dict[str, Any]]) -> dict[str, Any]:
    """What the job ran, as the watch saw it (the trainer's choices included): ZeRO stage, checkpointing."""
    nonre = sum(e.get("checkpointing", {}).get("non_reentrant_recomputes", 0) for e in engines)
    re_ = sum(e.get("checkpointing", {}).get("reentrant_module_recomputes", 0) for e in engines)
    kinds = [k for k, n in (("non-reentrant", nonre), ("reentrant", re_)) if n]
    steps: dict[str, list[int]] = {}
    for e in engines:
        for kind, (first, last) in e.get("checkpointing", {}).get("steps", {}).items():
            f0, l0 = steps.get(kind, [first, last])
            steps[kind] = [min(f0, first), max(l0, last)]
    out = {"zero_stage": max((e.get("stage", 0) for e in engines), default=None),
           "activation_checkpointing": " and ".join(kinds) if kinds else "none seen",
           "non_reentrant_recomputes": nonre, "reentrant_module_recomputes": re_, "checkpointing_steps": steps}
    if len(steps) == 2:
        out["checkpointing_switched"] = ("the job switched activation checkpointing while it trained: "
                                         + ", ".join(f"{k} in train steps {a + 1}-{b + 1}"
                                                     for k, (a, b) in sorted(steps.items(), key=lambda kv: kv[1]))
                                         + " (something enabled checkpointing again with other settings)")
    return out


def crashes(engines: list[dict[str, Any]], processes: list[dict[str, Any]],
            exit_status: int | None = None) -> list[dict[str, Any]]:
    """Exceptions that ended a process outside a watched engine's calls (those inside are engine findings); a
    non-zero ``sys.exit`` counts when the command failed (the exception it was handling, if any, in its message)."""
    out = []
    failed = exit_status not in (None, 0)
    for p in processes:
        c = p.get("crash") or (p.get("exit") if failed else None)
        if not c or c.get("in_engine_call"):
            continue
        out.append({"spec": "exception", "message": f"{c['type']}: {c['message']}", "event": None,
                    "step": c.get("step"), "backward": c.get("backward"), "count": 1,
                    "in": "the job, outside DeepSpeed's engine calls", "traceback": c.get("traceback"),
                    "events": [], "modules": [], "params": [], "rank": c.get("rank"), "pid": p.get("pid"),
                    "deepspeed": p.get("deepspeed")})
    return out


__all__ = ["NO_ENGINE", "configuration", "crashes", "not_checked", "problems"]
