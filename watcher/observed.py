"""What the watch observed of a job, and what it did not: said loudly, apart from the findings about DeepSpeed.

`problems` are the watch's own failures to observe -- no engine watched (with the likely cause, read from
the processes' records, `zerostate.watcher.process`), a rank that ended before its events were checked, a
``--runtime`` that did not install, the watch failing itself --; `unwatched_ranks`, each rank of the job's world
size that no watched engine reported (or whose file could not be read); `unexercised_specs`, the specs no event of
any rank exercised (`spec_results`: such a spec reads "not observed", never "ok").  All of them make ``zerostate
watch`` exit non-zero even when the job exited 0.  `not_checked` names the parts of a watched job the specs could
not judge (a reentrant checkpoint's recompute).  `configuration` says what the job ran (checkpointing as the trainer
left it).  `crashes` are the exceptions that ended a process outside DeepSpeed's engine calls; `ranks` counts
backwards and steps per rank.
"""

from __future__ import annotations

from typing import Any

from zerostate.model.events import EventKind
from zerostate.specs import SPECS

NO_ENGINE = "no DeepSpeed engine was watched"
NOT_OBSERVED = "not observed"
"""A spec's result when no event of any rank exercised it (`exercised`)."""

_BACKWARD = (EventKind.USER_BACKWARD_START.value, "a user backward")
_NEEDS: dict[str, tuple[str, str]] = {
    **{sid: _BACKWARD for sid, s in SPECS.items() if s.family == "hooks"},
    "released-after-backward": _BACKWARD,
    "clean-step": (EventKind.STEP.value, "a train step (engine.step at the accumulation boundary)"),
}
"""What a spec judges besides the events it reacts to: the backward specs a user backward (an eval forward is an
event they react to, and judges nothing of a backward), ``clean-step`` a train step."""


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
    for e in engines:
        for other in e.get("shares_parameters_with", []):
            if other > e.get("engine", 0):  # said once per pair
                out.append(
                    f"rank {e['rank']} (pid {e.get('pid')}): engines {e.get('engine')} and {other} wrap the same "
                    "parameters while both are live (the first was not destroyed): both engines' hooks run in each "
                    "one's forwards and backwards, and the watch cannot tell which engine gathered or released a "
                    "shared parameter -- findings on either engine may come from the other's hooks")
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


def exercised(spec_id: str, kinds: set[str]) -> bool:
    """Some event of ``kinds`` (event kind values seen) exercises ``spec_id``: one the spec reacts to
    (`zerostate.specs.Spec.reacts_to`), and what it judges (`_NEEDS`: a user backward, a train step)."""
    spec = SPECS.get(spec_id)
    if spec is None:
        return bool(kinds)
    reacts = spec.reacts_to
    if reacts is not None and not any(k.value in kinds for k in reacts):
        return False
    need = _NEEDS.get(spec_id)
    return need is None or need[0] in kinds


def spec_results(engines: list[dict[str, Any]]) -> dict[str, str]:
    """Each spec's result before its violations: ``ok`` when an event of a watched engine that checks it exercised it
    (`exercised`), ``not observed`` when none did, ``not checked`` when no engine checks it (the coordinator specs on
    ZeRO-1/2, which have no parameter coordinator).  An engine file without the lists (a watch before them) is taken
    as exercising what it checked."""
    out = {}
    for sid, s in SPECS.items():
        checking = [e for e in engines if sid in e.get("specs", [sid] if s.family == "hooks" or e.get("stage") == 3
                                                    else [])]
        if not checking:
            out[sid] = NOT_OBSERVED if not engines else "not checked"
        elif any("kinds" not in e or exercised(sid, set(e["kinds"])) for e in checking):
            out[sid] = "ok"
        else:
            out[sid] = NOT_OBSERVED
    return out


def unexercised_specs(engines: list[dict[str, Any]], results: dict[str, str], status: str) -> list[str]:
    """The specs no event of any rank exercised, grouped by what they lacked, as sentences (none while the job
    runs, or when no engine was watched: that is said first)."""
    if status == "running" or not engines:
        return []
    missing = [sid for sid, r in results.items() if r == NOT_OBSERVED]
    if not missing:
        return []
    kinds = set().union(*(set(e.get("kinds", ())) for e in engines))
    groups: dict[str, list[str]] = {}
    for sid in missing:
        need = _NEEDS.get(sid)
        if need is not None and need[0] not in kinds:
            why = f"no {need[1].removeprefix('a ')} was watched on any rank"
        else:
            reacts = SPECS[sid].reacts_to or ()
            why = "no event it judges (" + ", ".join(sorted(k.value for k in reacts)[:6]) + ") was watched"
        groups.setdefault(why, []).append(sid)
    return [f"{why}: {', '.join(f'`{s}`' for s in sids)} never judged anything (\"{NOT_OBSERVED}\", not ok)"
            for why, sids in groups.items()]


def world_size(engines: list[dict[str, Any]], processes: list[dict[str, Any]], launcher: int | None) -> int | None:
    """The job's world size: the largest a watched engine or a rank's process saw (torch.distributed's, else
    ``WORLD_SIZE``), else the launcher's (``--nproc-per-node``, ``--num_gpus``...: `zerostate.watcher.job_launch`),
    else 1 when an engine was watched."""
    seen = [e.get("world_size") for e in engines] + [p.get("world_size") for p in processes if p.get("rank_known")]
    sizes = [w for w in seen if isinstance(w, int) and w > 0]
    if sizes:
        return max(sizes)
    return launcher if launcher else (1 if engines else None)


def ranks(engines: list[dict[str, Any]], world: int | None) -> list[dict[str, Any]]:
    """One row per rank of ``world`` (and any other rank a watched engine reported): watched or not, its engines,
    backwards and steps (summed over its engines), events folded."""
    out = []
    for r in sorted(set(range(world or 0)) | {e["rank"] for e in engines}):
        mine = [e for e in engines if e["rank"] == r]
        pids = sorted({int(e["pid"]) for e in mine if e.get("pid") is not None})
        out.append({"rank": r, "watched": bool(mine), "pids": pids,
                    "engines": len(mine), "backwards": sum(e.get("backwards", 0) for e in mine),
                    "steps": sum(e.get("steps", 0) for e in mine), "events": sum(e.get("events", 0) for e in mine)})
    return out


def unwatched_ranks(engines: list[dict[str, Any]], processes: list[dict[str, Any]], world: int | None,
                    unreadable: list[dict[str, Any]], status: str) -> list[str]:
    """Each rank of the job's world size that no watched engine reported, with why, as sentences; and every watch file
    that could not be read (what it held is not in the report).  Nothing while the job runs; when no engine was watched
    at all, only the unreadable files (the cause is said first, `problems`)."""
    out = [f"the watch file {u['file']} could not be read ({u['why']}): what it held is not in this report"
           for u in unreadable]
    if status == "running" or not engines:
        return out
    for r in range(world or 0):
        if any(e["rank"] == r for e in engines):
            continue
        out.append(f"rank {r} of {world} was never watched: {_unwatched_cause(r, processes, unreadable)}")
    return out


def _unwatched_cause(rank: int, processes: list[dict[str, Any]], unreadable: list[dict[str, Any]]) -> str:
    lost = [u["file"] for u in unreadable if u["file"].startswith(f"rank{rank}-")]
    if lost:
        return f"its watch file {lost[0]} could not be read"
    mine = [p for p in processes if p.get("rank_known") and p.get("rank") == rank]
    if not mine:
        return ("no process of that rank ran the watch (its launcher did not pass the watch's environment -- "
                "PYTHONPATH with zerostate's sitecustomize and ZEROSTATE_WATCH_DIR -- to it, as pdsh, a scheduler or "
                "a launcher that does not forward every variable leaves it; or it runs on another node), so nothing "
                "it did was checked")
    p = mine[0]
    c = p.get("crash") or p.get("exit")
    if c:
        return f"its process (pid {p['pid']}) ended, of {c['type']}: {c['message'][:200]}, before an engine was watched"
    if p.get("watch_errors"):
        return f"the watch failed there: {p['watch_errors'][0]}"
    if p.get("skipped"):
        return f"deepspeed.initialize built only engines the watch does not judge there: {p['skipped'][0]}"
    if not p.get("deepspeed"):
        return f"its process (pid {p['pid']}) never imported deepspeed"
    return f"deepspeed was imported there (pid {p['pid']}) but deepspeed.initialize never built an engine"


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
    """Exceptions that ended a process outside a watched engine's calls (those inside are the engines'); a non-zero
    ``sys.exit`` counts when the command failed (the exception it was handling, if any, in its message).  Each carries
    what the process judged of it (``job_crash``: its own code raised it; else the known issue, `zerostate.watcher
    .judge`), or, when the process could not judge it, ``job_crash`` from its frames and no label."""
    out = []
    failed = exit_status not in (None, 0)
    for p in processes:
        c = p.get("crash") or (p.get("exit") if failed else None)
        if not c or c.get("in_engine_call"):
            continue
        judged = c.get("judged") or _judged_here(c)
        out.append(dict(judged, spec="exception", message=f"{c['type']}: {c['message']}", event=None,
                        step=c.get("step"), backward=c.get("backward"), count=1,
                        traceback=c.get("traceback"), events=[], modules=[], params=[], rank=c.get("rank"),
                        pid=p.get("pid"), deepspeed=p.get("deepspeed"), frames=c.get("frames", []),
                        **{"in": "the job, outside DeepSpeed's engine calls"}))
    return out


def _judged_here(c: dict[str, Any]) -> dict[str, Any]:
    """A crash the process could not judge (`zerostate.watcher.process.Crash` without ``judged``): the job's crash
    when its frames say so (or a ``sys.exit`` handling nothing); never labelled here (no trace)."""
    from zerostate.watcher.judge import raised_by_the_job, where_in_the_job
    frames = c.get("frames") or []
    own_exit = c["type"] == "SystemExit" and ", handling " not in c["message"]
    job = own_exit or raised_by_the_job(frames)
    return {"job_crash": job, "where": "sys.exit" if own_exit else where_in_the_job(frames), "known_issue": None,
            "explanation": None}


__all__ = ["NOT_OBSERVED", "NO_ENGINE", "configuration", "crashes", "exercised", "not_checked", "problems", "ranks",
           "spec_results", "unexercised_specs", "unwatched_ranks", "world_size"]
