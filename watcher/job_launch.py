"""Running a user's job watched (``zerostate watch``, whose command is `zerostate.cli.cmd_watch`).

The job runs with a ``sitecustomize.py`` first on ``PYTHONPATH``, so every Python process it starts watches
every engine ``deepspeed.initialize`` builds (`zerostate.watcher.watch.enable`); each writes
``DIR/ranks/rank<r>-<pid>-<n>.json`` as it goes, and this process merges them into ``DIR/report.json``
and ``report.md`` (`zerostate.watcher.job_report`) while the job runs (every 2 s) and at its end.  Ctrl-C
reaches the job (same process group) and the report keeps everything seen; ``"status": "interrupted"``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from zerostate.watcher import process
import zerostate.jit_ops as jit_ops
from zerostate.watcher import job_report as watch_report

NOT_OBSERVED = 3
"""Exit status of a job that exited 0 but that the watch did not fully observe (`zerostate.watcher.observed`): no
engine watched, a rank of the job's world size never watched (or its file unreadable), a spec no event exercised
(read "not observed"), a rank that ended before its events were checked, ``--runtime`` not installed."""

SITECUSTOMIZE = '''\
"""Written by `zerostate watch`: watch every DeepSpeed engine this process builds, then run the
sitecustomize this one shadows, if any."""
import os
import sys

if os.environ.get("ZEROSTATE_WATCH_DIR"):
    try:
        from zerostate.watcher.watch import enable
        enable()
    except Exception as exc:  # never stop the user's process; the report says it was not watched, and why
        print(f"zerostate watch: not watching pid {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        import json
        path = os.path.join(os.environ["ZEROSTATE_WATCH_DIR"], f"proc-{os.getpid()}.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"pid": os.getpid(), "argv": sys.argv[:8], "watch_errors": [
                f"zerostate could not watch pid {os.getpid()}: {type(exc).__name__}: {exc}"]}, fh)

def _chain():
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and spec.origin != os.path.abspath(__file__):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))

_chain()
'''



class JobNotStarted(Exception):
    """The job's command could not be started; the message is the operating system's."""


@dataclass(frozen=True)
class WatchOptions:
    """What the watch does inside the job (``zerostate watch``'s options)."""

    stop_on_violation: bool = False
    runtime: bool = False
    hang_after: float = 300.0
    """Seconds one engine call may last before the rank writes its stack (0: never)."""


def _exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def run_watched(job: list[str], out_dir: str, options: WatchOptions) -> tuple[int, dict[str, Any]]:
    """Run ``job`` watched into the report folder ``out_dir``: its exit status (a signal death reads 128+N) and
    the merged report."""
    out = os.path.abspath(out_dir)
    ranks = os.path.join(out, "ranks")
    site = os.path.join(out, ".site")
    for d in (ranks, site):
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
    for name in ("report.json", "report.md", "memory.svg"):
        if os.path.exists(os.path.join(out, name)):
            os.unlink(os.path.join(out, name))
    for name in os.listdir(out):
        if name.startswith(("trace_", "memory_")):
            os.unlink(os.path.join(out, name))
    with open(os.path.join(site, "sitecustomize.py"), "w", encoding="utf-8") as fh:
        fh.write(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([site] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    jit_ops.keep_apart(env)  # the job's DeepSpeed release builds its JIT ops apart from other releases
    env.update({"ZEROSTATE_WATCH_DIR": ranks, "ZEROSTATE_WATCH_STOP": "1" if options.stop_on_violation else "0",
                "ZEROSTATE_WATCH_RUNTIME": "1" if options.runtime else "0",
                "ZEROSTATE_WATCH_HANG": str(options.hang_after) if options.hang_after else "0"})
    started, t0 = watch_report.now(), time.monotonic()
    interrupted = []

    def on_sigint(signum: int, frame: object) -> None:  # the job got it too (same process group); wait for it to finish
        interrupted.append(time.monotonic())

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        proc = subprocess.Popen(job, env=env)
    except OSError as exc:
        signal.signal(signal.SIGINT, previous)
        raise JobNotStarted(str(exc)) from None
    forwarded = False
    stamp = None
    try:
        while True:
            try:
                rc = proc.wait(timeout=2.0)
                break
            except subprocess.TimeoutExpired:
                pass
            if interrupted and not forwarded and time.monotonic() - interrupted[0] > 2.0:
                proc.send_signal(signal.SIGINT)  # Ctrl-C sent to us alone (kill -INT): pass it on once
                forwarded = True
            stamp = _merge_if_changed(out, ranks, job, "running", None, started, t0, options.runtime, stamp)
    finally:
        signal.signal(signal.SIGINT, previous)
    status = "interrupted" if interrupted else "complete"
    data = _merge(out, ranks, job, status, _exit_status(rc), started, t0, options.runtime)
    return _exit_status(rc), data


_WORLD_OPTIONS = {"torchrun": ("--nproc-per-node", "--nproc_per_node"),
                  "torch.distributed.run": ("--nproc-per-node", "--nproc_per_node"),
                  "torch.distributed.launch": ("--nproc-per-node", "--nproc_per_node"),
                  "deepspeed": ("--num_gpus", "--num-gpus"),
                  "accelerate": ("--num_processes", "--num-processes")}
_FLAGS = frozenset({"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
                    "--no_local_rank", "--no-local-rank", "--force_multi", "--use_deepspeed", "--multi_gpu", "--cpu",
                    "--debug", "-h", "--help"})
"""Launcher options that take no value."""
_NODE_OPTIONS = {"torchrun": ("--nnodes",), "torch.distributed.run": ("--nnodes",),
                 "torch.distributed.launch": ("--nnodes",), "deepspeed": ("--num_nodes", "--num-nodes")}


def launcher_world_size(job: list[str]) -> int | None:
    """The world size a launcher's command line gives: ``torchrun`` / ``python -m torch.distributed.run``
    ``--nproc-per-node N`` (times ``--nnodes M``), ``deepspeed --num_gpus N`` (times ``--num_nodes M``),
    ``accelerate launch --num_processes N``; None when the command is no such launcher or does not say (``auto``,
    a range of nodes, a hostfile).  Only the launcher's own options are read: those before the training script."""
    if not job:
        return None
    name = os.path.basename(job[0])
    args = job[1:]
    if name.startswith("python") and len(args) >= 2 and args[0] == "-m":
        name, args = args[1], args[2:]
    if name == "accelerate":
        if not args or args[0] != "launch":
            return None
        args = args[1:]
    if name not in _WORLD_OPTIONS:
        return None
    found: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("-"):
            break  # the training script: what follows is its own
        key, eq, value = a.partition("=")
        if not eq and key not in _FLAGS and i + 1 < len(args) and not args[i + 1].startswith("-") and (
                key in _WORLD_OPTIONS[name] or key in _NODE_OPTIONS.get(name, ())
                or not (args[i + 1].endswith(".py") or os.path.exists(args[i + 1]))):
            value = args[i + 1]  # an option's value (a script is a .py or an existing file)
            i += 1
        found[key] = value
        i += 1
    per = next((found[k] for k in _WORLD_OPTIONS[name] if k in found), None)
    nodes = next((found[k] for k in _NODE_OPTIONS.get(name, ()) if k in found), "1")
    if per is None or not per.isdigit():
        return None
    lo, _, hi = nodes.partition(":")
    if not lo.isdigit() or (hi and hi != lo):
        return None
    return int(per) * int(lo)


def exit_status(job: int, data: dict[str, Any]) -> int:
    """The job's own exit status; `NOT_OBSERVED` when it exited 0 but the watch failed to observe it (no engine
    watched, a rank never watched, a spec no event exercised, a rank that ended before its events were checked,
    ``--runtime`` not installed)."""
    return job if job or not data["not_observed"] else NOT_OBSERVED


def _merge(out: str, ranks: str, job: list[str], status: str, rc: int | None, started: str, t0: float,
           runtime: bool) -> dict[str, Any]:
    engines, unreadable = watch_report.read_rank_files(ranks)
    processes, unreadable_procs = process.load_all(ranks)
    data = watch_report.build(engines, watch_report.hung_stacks(ranks) if status != "complete" or rc else [], job,
                              status, rc, started, time.monotonic() - t0, processes, runtime,
                              launcher_world_size(job), unreadable + unreadable_procs)
    watch_report.write(out, data)
    return data


def _merge_if_changed(out: str, ranks: str, job: list[str], status: str, rc: int | None, started: str, t0: float,
                      runtime: bool, stamp: tuple | None) -> tuple | None:
    try:
        now = tuple(sorted((e.name, e.stat().st_mtime_ns) for e in os.scandir(ranks)))
    except OSError:
        return stamp
    if now != stamp:
        _merge(out, ranks, job, status, rc, started, t0, runtime)
    return now


__all__ = ["JobNotStarted", "NOT_OBSERVED", "SITECUSTOMIZE", "WatchOptions", "exit_status", "launcher_world_size",
           "run_watched"]
