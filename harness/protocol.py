"""The payloads that cross a process boundary: the worker's and the rank pool's JSON-lines protocol.

Requests (one JSON line each on a worker's stdin)::

    {"op": "hello"}                      -> `Hello` (or a `Failure`, repeated to every request)
    {"op": "run", "scenario": {...}}     -> `RunAnswer` (a rank sends `StepProgress` lines first) or `Failure`
    {"op": "state"}                      -> `StateAnswer` (tests: the process's global state)
    {"op": "exit"}                       -> (the worker exits)

The scenario travels as ``Scenario.to_dict()`` and is parsed once, by the receiving worker
(``Scenario.from_dict``); a run's `findings.record.RunRecord` travels as ``wire.to_wire(record)`` and is read
once, by the parent (``wire.from_wire``).  Every field is typed: JSON values are `Json`, never ``Any``.
Stdlib only: repro scripts embed this module.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from zerostate.findings.wire import Json


class HelloRequest(TypedDict):
    op: Literal["hello"]


class ExitRequest(TypedDict):
    op: Literal["exit"]


class StateRequest(TypedDict):
    """Tests: the worker's global state (`process_state`), to compare a forked worker with a started one."""

    op: Literal["state"]


class Stall(TypedDict):
    """Tests: rank ``rank`` sleeps ``seconds`` before the run (a simulated hang)."""

    rank: int
    seconds: float


class _RunRequestBase(TypedDict):
    op: Literal["run"]
    scenario: Json
    """``Scenario.to_dict()``."""


class RunRequest(_RunRequestBase, total=False):
    sleep: float
    """Tests: the world-size-1 worker sleeps this long before the run (a simulated hang)."""
    stall: Stall
    unmatched: int
    """Tests: this rank issues one extra collective after the run (ranks out of step)."""
    coverage: bool
    """Measure the run's arcs of DeepSpeed's ZeRO files and return them (`RunAnswer.coverage`)."""
    perturb: list[tuple[str, float]]
    """Tests: DeepSpeed's update of these parameters is observed multiplied by the factor (`executor.execute`)."""


Request = HelloRequest | RunRequest | ExitRequest | StateRequest


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
    """From the process's start to the answer: imports, JIT builds of DeepSpeed's ops, warm-up (a forked worker:
    from its fork; its imports and warm-up were its fork server's)."""
    server_startup_seconds: float
    """A forked worker: its fork server's imports and warm-up, paid once for every worker it forks."""
    jit_builds: list[str]
    """The ops DeepSpeed JIT-built into the process's extensions folder during start-up."""
    error: str
    traceback: str


class StateAnswer(TypedDict):
    """The answer to a `StateRequest`."""

    ok: Literal[True]
    state: Json


class _RunAnswerBase(TypedDict):
    ok: Literal[True]
    result: Json
    """The run's `findings.record.RunRecord`, as ``wire.to_wire`` writes it."""
    seconds: float


class RunAnswer(_RunAnswerBase, total=False):
    cpu_seconds: float
    """The worker process's CPU time for the run (`time.process_time`)."""
    oracle_seconds: float
    """... of it, its plain-PyTorch references' (oracle and counterfactuals)."""
    sync: dict[str, int]
    """A rank: each process group's collective sequence number after the run."""
    coverage: dict[str, list[int]]
    """Asked for by the request: per DeepSpeed file coverage.py traces, the arcs the run executed
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
    result: Json
    """The rank's `RunRecord` (``wire.to_wire``), or null when the rank answered with a `Failure`."""
    steps: list[dict[str, str]]
    error: str | None


class PoolAnswer(TypedDict, total=False):
    """The rank pool's answer: rank 0's (or the first failing rank's) with every rank's record."""

    result: Json
    seconds: float
    cpu_seconds: float
    """Every rank's CPU time for the run, summed."""
    oracle_seconds: float
    """Every rank's oracle CPU seconds, summed."""
    sync: dict[str, int]
    ranks: list[RankRecord]
    desync: str
    coverage: dict[str, list[int]]


Answer = Hello | RunAnswer | StateAnswer | Failure
"""What a worker sends back to one request."""


class Response(Hello, PoolAnswer, total=False):
    """An answer as the parent reads it, before ``ok`` says which it is: every field any answer may hold."""

    state: Json

__all__ = ["Answer", "ExitRequest", "Failure", "Hello", "HelloRequest", "Json", "PoolAnswer", "RankRecord", "Request",
           "Response", "RunAnswer", "RunRequest", "Stall", "StateAnswer", "StateRequest", "StepProgress"]
