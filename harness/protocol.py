"""The payloads that cross a process boundary: the worker's and the rank pool's JSON-lines protocol, and the
executor's result inside it.

Requests (one JSON line each on a worker's stdin)::

    {"op": "hello"}                      -> `Hello` (or a `Failure`, repeated to every request)
    {"op": "run", "scenario": {...}}     -> `RunAnswer` (a rank sends `StepProgress` lines first) or `Failure`
    {"op": "exit"}                       -> (the worker exits)

The scenario travels as ``Scenario.to_dict()`` and is parsed once, by the receiving worker
(``Scenario.from_dict``).  Stdlib only: repro scripts embed this module.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

EventDict = dict[str, Any]
"""One tracer event (`zerostate.model.events.Event.to_dict`)."""


class HelloRequest(TypedDict):
    op: Literal["hello"]


class ExitRequest(TypedDict):
    op: Literal["exit"]


class Stall(TypedDict):
    """Tests: rank ``rank`` sleeps ``seconds`` before the run (a simulated hang)."""

    rank: int
    seconds: float


class _RunRequestBase(TypedDict):
    op: Literal["run"]
    scenario: dict[str, Any]


class RunRequest(_RunRequestBase, total=False):
    sleep: float
    """Tests: the world-size-1 worker sleeps this long before the run (a simulated hang)."""
    stall: Stall
    unmatched: int
    """Tests: this rank issues one extra collective after the run (ranks out of step)."""
    coverage: bool
    """Measure the run's arcs of DeepSpeed's ZeRO files and return them (`RunAnswer.coverage`)."""


Request = HelloRequest | RunRequest | ExitRequest


class Failure(TypedDict, total=False):
    """Any request that failed: DeepSpeed did not import (every request gets it), or the run raised."""

    ok: Literal[False]
    error: str
    traceback: str


class Hello(TypedDict, total=False):
    """The start-up answer."""

    ok: bool
    deepspeed: str
    """The imported release's ``__version__`` (a checkout: the version its ``version.txt`` declares)."""
    file: str
    torch: str
    device: str
    rank: int
    world_size: int
    backend: str
    startup_seconds: float
    """From the process's start to the answer: imports, JIT builds of DeepSpeed's ops, warm-up."""
    jit_builds: list[str]
    """The ops DeepSpeed JIT-built into the process's extensions folder during start-up."""
    error: str
    traceback: str


class Fp16Result(TypedDict, total=False):
    skipped_steps: int
    loss_scale: float
    oracle_skipped: list[int] | None
    oracle_scales: list[float] | None
    oracle_scale: float | None
    """The oracle's scale after the last step, compared with ``loss_scale`` (the one the next step would use)."""


class SaveLoadResult(TypedDict):
    """One checkpoint round trip as the executor reports it."""

    step: int
    files: list[str] | None
    loaded: Any
    state16: list[str] | None
    fp32: list[str] | None


class _ExecBase(TypedDict):
    events: list[EventDict]
    error: str | None
    error_check: str | None
    traceback: str | None
    mismatch: str | None
    steps: int


class ExecResult(_ExecBase, total=False):
    """`zerostate.harness.executor.execute`'s result; its module docstring says what each field holds."""

    max_diff: float
    masters: list[list[float]]
    masters_unread: dict[str, str]
    fp16: Fp16Result
    skipped: str
    engines_before: list[str]
    carried_state: str
    persistence: str
    engine: dict[str, Any]
    save_load: list[SaveLoadResult]
    checkpoint: list[str]
    torch_linear_replaced: bool
    origin: str
    teardown_error: str
    oracle_diff: dict[str, Any]
    """How DeepSpeed's parameters differ from PyTorch's (`harness.evidence.oracle_diff`)."""
    frames: list[list[Any]]
    """The raised exception's frames (`findings.evidence.frames_of`)."""


class _RunAnswerBase(TypedDict):
    ok: Literal[True]
    result: ExecResult
    seconds: float


class RunAnswer(_RunAnswerBase, total=False):
    sync: dict[str, int]
    """A rank: each process group's collective sequence number after the run."""
    coverage: dict[str, list[int]]
    """Asked for by the request: per measured DeepSpeed file, the arcs the run executed
    (`coverage_probe.arc_id` integers, sorted).  A rank pool answers with rank 0's."""


class StepProgress(TypedDict):
    """A rank, after each train step: a checksum of every gathered parameter."""

    progress: Literal["step"]
    step: int
    digests: dict[str, str]


class RankRecord(TypedDict):
    """One rank's part of a rank-pool answer."""

    rank: int
    ok: bool | None
    result: ExecResult | None
    steps: list[dict[str, str]]
    error: str | None


class PoolAnswer(TypedDict, total=False):
    """The rank pool's answer: rank 0's (or the first failing rank's) with every rank's record."""

    result: ExecResult
    seconds: float
    sync: dict[str, int]
    ranks: list[RankRecord]
    desync: str
    coverage: dict[str, list[int]]


Answer = Hello | RunAnswer | Failure
"""What a worker sends back to one request."""


class Response(Hello, PoolAnswer, total=False):
    """An answer as the parent reads it, before ``ok`` says which it is: every field any answer may hold."""

__all__ = ["Answer", "EventDict", "ExecResult", "ExitRequest", "Failure", "Fp16Result", "Hello", "HelloRequest",
           "PoolAnswer", "RankRecord", "Request", "Response", "RunAnswer", "RunRequest", "SaveLoadResult", "Stall",
           "StepProgress"]
