"""The JSON-lines worker loop and DeepSpeed start-up, shared by both worker processes.

`worker` (world size 1, one process per target) and `rank_worker` (one process per rank of the rank
pool) are the same program around this loop: they differ only in how they start (the rank worker dies
with its parent, warms up, answers with its process group's rank) and in what a ``run`` request does
besides ``executor.execute`` (the rank worker reports a checksum line per train step and its collective
sequence numbers).  The protocol::

    {"op": "hello"}                  -> the start-up answer (``{"ok": true, "deepspeed": ..., ...}``), or
                                        ``{"ok": false, "error": ..., "traceback": ...}`` when DeepSpeed did
                                        not import or initialise (that answer is given to every request)
    {"op": "run", "scenario": {...}} -> ``run(request, reply)``'s answer (plus any lines it sends itself);
                                        with ``"coverage": true`` also the arcs it ran (`coverage_probe`)
    {"op": "state"}                  -> ``{"ok": true, "state": ...}``: the process's global state (tests compare
                                        a forked worker's with a started one's: `process_state`)
    {"op": "exit"}                   -> (the loop returns)
    anything else                    -> {"ok": false, "error": "unknown op ..."}

One request per line on stdin, one answer per line on the protocol stream: the process's original
stdout.  `open_protocol` moves file descriptor 1 onto stderr first, so everything DeepSpeed prints goes
to the worker's log, never into the protocol.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

if TYPE_CHECKING:
    from zerostate.findings.record import RunRecord
    from zerostate.harness.coverage_probe import Meter, Probe

import zerostate.jit_ops as jit_ops
from zerostate.findings.wire import to_wire
from zerostate.harness.protocol import Answer, Failure, Hello, RunAnswer, RunRequest, StepProgress

_IMPORTED = time.time()

Reply = Callable[[Answer | StepProgress], None]
"""Sends one JSON line on the protocol stream."""
Run = Callable[[RunRequest, Reply], Answer]
"""What a ``run`` request does: its answer (a rank also sends progress lines through the reply)."""


def open_protocol() -> Reply:
    """Keep the original stdout as the protocol stream; send fd 1 (and ``sys.stdout``) to stderr.
    Returns ``reply(obj)``: one JSON line on the protocol stream."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # DeepSpeed's prints and logs go to stderr, never into the protocol
    sys.stdout = sys.stderr

    def reply(obj: Answer | StepProgress) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()
    return reply


class RunClock:
    """One run's clocks, from its request on: the wall clock, the process's CPU time, and the oracle's share of it
    (``timing``, which `executor.execute` fills); `answer` is the run's answer with the three."""

    def __init__(self) -> None:
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        self.timing: dict[str, float] = {"oracle": 0.0}

    def answer(self, record: RunRecord) -> RunAnswer:
        return {"ok": True, "result": to_wire(record), "seconds": time.perf_counter() - self.t0,
                "cpu_seconds": time.process_time() - self.cpu0, "oracle_seconds": self.timing["oracle"]}


def failure(exc: BaseException, prefix: str = "") -> Failure:
    """The answer for an exception: ``{"ok": false, "error": "<prefix>Type: message", "traceback": ...}``."""
    return {"ok": False, "error": f"{prefix}{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exc().splitlines(True)[-15:])}


def start_deepspeed(skip_shm_comm: bool) -> Hello:
    """`_start_deepspeed`, timed from the process's start, with the ops DeepSpeed JIT-built meanwhile into its
    extensions folder (``startup_seconds``, ``jit_builds``: a first build is start-up, never an example's)."""
    folder = os.environ.get(jit_ops.ENV, "")
    before = jit_ops.built_ops(folder)
    hello = _start_deepspeed(skip_shm_comm)
    hello["startup_seconds"] = round(_seconds_since_start(), 3)
    if os.environ.get("ZEROSTATE_FORKED"):  # forked from a fork server: what its imports and warm-up took
        hello["server_startup_seconds"] = float(os.environ["ZEROSTATE_FORKED"])
    hello["jit_builds"] = jit_ops.new_builds(before, jit_ops.built_ops(folder))
    return hello


def _seconds_since_start() -> float:
    """Seconds since this process started (a forked one: since its fork).  Linux: its start in clock ticks since
    boot (``/proc/PID/stat``) against the uptime (``/proc/uptime``, 10 ms); never against ``btime`` of
    ``/proc/stat``, a whole second, whose truncation would add up to a second to every start measured.
    Elsewhere: since this module was imported."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


def _start_deepspeed(skip_shm_comm: bool) -> Hello:
    """Import DeepSpeed on CPU or CUDA and initialise torch.distributed once (gloo on CPU, nccl on CUDA)
    from ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``.  Returns the hello fields every
    worker sends: ``deepspeed``, ``file``, ``torch``, ``device``.  ``skip_shm_comm``: on CPU, skip building
    DeepSpeed's shm communication op (it serves ``inference_all_reduce`` only; training uses gloo).
    Raises whatever the import or the initialisation raised."""
    from zerostate.tracing import compat
    from zerostate.harness.net.dist import setup_distributed
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    if skip_shm_comm and not torch.cuda.is_available():
        compat.skip_shm_comm_op()
    setup_distributed()
    _warm_imports()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # tiny tensors: threads only cost
    return {"ok": True, "deepspeed": deepspeed.__version__, "file": deepspeed.__file__,
            "torch": torch.__version__, "device": "cuda" if torch.cuda.is_available() else "cpu"}


@runtime_checkable
class _ZeroOptimizerCheck(Protocol):
    """The release's ``deepspeed.runtime.zero.utils`` with its optimizer check."""

    def is_zero_supported_optimizer(self, optimizer: Any) -> bool: ...


def _warm_imports() -> None:
    """Import at start-up what the first run would import, so a worker's first ZeRO run costs what the next
    ones cost (what the first run paid before: docs/deepspeed-target.md, worker warm-up): ``torch._dynamo``
    (the first ``torch.optim`` constructor imports it) and whatever the release's ZeRO optimizer check imports
    (0.19.8's ``is_zero_supported_optimizer`` imports its Muon optimizer, whose ``torch.compile`` decorators
    import inductor).  The same calls every run makes, on a throw-away parameter; so a spare worker started
    ahead (`DeepSpeedTarget.fresh`) has paid them before it is used."""
    import torch
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    from deepspeed.runtime.zero import utils as zero_utils
    if isinstance(zero_utils, _ZeroOptimizerCheck):
        zero_utils.is_zero_supported_optimizer(probe)
    del probe
    _warm_llama_once()
    gc.collect()  # and what survives the imports is frozen, as after the first run (executor._RUNS): the
    gc.freeze()   # first run's own full collections then scan only its objects, not every import's


def warm_before_fork() -> dict[str, Any]:
    """What `fork_server` does before its first fork: every import and warm-up a start makes (`_start_deepspeed`,
    `_warm_imports`) that needs no process group, so a forked worker's own `start_deepspeed` pays only its
    process group and the optimizer check's call.  Returns the server's hello: ``fork`` false (with ``why``)
    where forking is unsafe -- CUDA (a CUDA runtime does not survive a fork) or a thread already running (a
    forked child would inherit its locks held)."""
    import torch
    if torch.cuda.is_available():
        return {"ok": True, "fork": False, "why": "CUDA is available: a forked process cannot use CUDA"}
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from zerostate.harness import executor, rank_worker, worker  # noqa: F401 -- imported by the child's main
    from zerostate.tracing import compat
    compat.skip_shm_comm_op()  # on CPU both worker programs skip it
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # imports torch._dynamo
    _import_optimizer_check()
    _warm_llama_once()
    gc.collect()
    gc.freeze()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
    if threads != 1:
        return {"ok": True, "fork": False, "why": f"{threads} threads run in the server after its imports "
                                                  "(a fork copies only one: locks the others hold stay held)"}
    return {"ok": True, "fork": True, "deepspeed": deepspeed.__version__, "file": deepspeed.__file__,
            "torch": torch.__version__}


def _import_optimizer_check() -> None:
    """Import what the release's ZeRO optimizer check imports when called (0.19.8: its Muon optimizer, whose
    ``torch.compile`` decorators import inductor) without calling it: it asks the process group for the rank,
    and the fork server has none.  The modules are the dotted names its code imports (``co_names``)."""
    import importlib

    from deepspeed.runtime.zero import utils as zero_utils
    check = getattr(zero_utils, "is_zero_supported_optimizer", None)
    code = getattr(check, "__code__", None)
    for name in getattr(code, "co_names", ()):
        if name.startswith("deepspeed.") and "." in name:
            try:
                importlib.import_module(name)
            except ImportError:  # the call would have caught it too
                continue


_WARMED_LLAMA = [False]
"""Whether this process built and ran the tiny Llama already (the fork server did, before forking it)."""


def _warm_llama_once() -> None:
    """`_warm_llama`, unless this process (or the fork server it was forked from) ran it already."""
    if not _WARMED_LLAMA[0]:
        _warm_llama()
        _WARMED_LLAMA[0] = True


def _warm_llama() -> None:
    """Build, run and drop one tiny PEFT-wrapped HF Llama (`torch_network.build_model`, the ``llama`` family), so
    the imports transformers and PEFT make lazily -- on their first model, first forward and first
    backward -- are paid at start-up and frozen with the rest, not by the first llama example a worker runs
    (docs/deepspeed-target.md, worker warm-up).  Without transformers or PEFT installed (the ``hf``
    extra) there is nothing to warm; the llama examples then fail on their own import."""
    from zerostate.harness.net.llama import SEQ
    from zerostate.harness.net.torch_network import build_model
    from zerostate.model.scenario import Block, Checkpoint, Family, Scenario
    try:
        model = build_model(Scenario(family=Family.LLAMA, lora=True, modules_to_save=True,
                                     blocks=(Block(checkpoint=Checkpoint.NON_REENTRANT),)))
    except ImportError:
        return
    import torch
    x = torch.zeros(1, SEQ, dtype=torch.long)
    model(input_ids=x, labels=x).loss.backward()


def serve(hello: Hello | Failure, run: Run, reply: Reply, error_prefix: str = "") -> int:
    """Answer requests from stdin until ``exit`` or end of input.  ``run(request, reply)`` returns the
    answer to a ``run`` request; an exception it raises is answered as a failure (``error_prefix`` first:
    the rank worker names its rank)."""
    probe, hello = _coverage_probe(hello)
    meters: list[Meter] = []  # the in-band meter, made by the first request that asks for coverage
    for raw in sys.stdin:
        line = raw.strip()
        if not line:
            continue
        req: dict[str, Any] = json.loads(line)
        op = req.get("op")
        if op == "exit":
            break
        if not hello.get("ok") or op == "hello":
            reply(hello)
            continue
        if op == "state":  # tests: what this process holds (a forked worker compared with a started one)
            from zerostate.harness.process_state import global_state
            reply({"ok": True, "state": global_state()})
            continue
        if op == "run":
            answer: Answer
            try:
                run_request = cast(RunRequest, req)
                answer = _answer_with_coverage(run_request, functools.partial(run, run_request, reply), probe, meters,
                                               hello)
            except BaseException as exc:  # noqa: BLE001 - report anything; the worker serves on
                answer = failure(exc, error_prefix)
            reply(answer)
        else:
            reply({"ok": False, "error": f"unknown op {op!r}"})
    return 0


def _answer_with_coverage(req: RunRequest, run: Callable[[], Answer], probe: Probe | None, meters: list[Meter],
                          hello: Hello | Failure) -> Answer:
    """``run()``'s answer; its coverage written to the probe's file when the probe samples it, and with its arcs
    in the answer (``coverage``, `coverage_probe.ArcIds`) when the request asks for them."""
    if not req.get("coverage"):
        return probe.around(req, run) if probe else run()
    from zerostate.harness import coverage_probe
    arcs: list[coverage_probe.ArcIds] = []

    def keep(arcs_by_file: dict[str, list[tuple[int, int]]]) -> None:
        arcs.append(coverage_probe.in_band(arcs_by_file))
    if probe is not None:  # one tracer at a time: the file's probe measures for both
        answer = probe.around(req, run, also=keep)
    else:
        if not meters:
            meters.append(coverage_probe.Meter(Path(str(hello.get("file"))).resolve().parent))
        answer = meters[0].measure(run, keep)
    if answer.get("ok") and arcs:
        cast(RunAnswer, answer)["coverage"] = arcs[0]
    return answer


def _coverage_probe(hello: Hello | Failure) -> tuple[Probe | None, Hello | Failure]:
    """The opt-in coverage probe (`coverage_probe`, off unless its variable is set) and the hello to give:
    a worker asked to measure that cannot (coverage.py missing) fails to start, loudly."""
    from zerostate.harness import coverage_probe
    try:
        return coverage_probe.from_env(hello), hello
    except ImportError as exc:
        return None, failure(exc, f"{coverage_probe.ENV} is set but coverage.py does not import: ")


__all__ = ["Reply", "failure", "open_protocol", "serve", "start_deepspeed"]
