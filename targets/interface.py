"""What every target is and returns: `Target`, `Outcome`, `Finding`, and `get_target`.

A *target* turns a `Scenario` into a trace and findings::

    target = get_target("deepspeed", deepspeed="0.18.4")   # or "model", design="ds-0.18.7"
    outcome = target.run(scenario)        # replay one scenario
    for f in outcome.findings: print(f.check, f.error)
    target.close()

``get_target(name, *, design=None, deepspeed=None, deepspeed_path=None, world_size=1)``
raises `TargetError` (a ``ValueError``) *before anything runs* for an unknown target
or design, an unsupported or uninstallable DeepSpeed version, or a
``--deepspeed-path`` that does not import.  Target kinds are a registry: each kind's
module calls `register(name, factory, validate)` (``model_target.py``: ``model``;
``deepspeed/kind.py``: ``deepspeed``), ``zerostate.targets`` imports those modules
(cheaply: no torch, no DeepSpeed), and `get_target` runs the kind's ``validate`` and
then its ``factory``.  This module imports none of its kinds.

`Finding` fields: ``check`` (a spec id, ``oracle``, ``exception``, ``hang``,
``saved-tensor-intact``, ``model-agreement``, ...), ``error`` (text), ``scenario``,
``trace`` (events, or None), ``index`` (the violating event's index in ``trace``,
or None), ``target``, ``deepspeed`` (the release, or None), ``origin`` (for
``exception``: ``ExcType@module.function`` of the innermost DeepSpeed frame), ``code``
(a spec finding's violation code, from the monitor's `Violation`), and, set by the explorer,
``confirmation`` and ``shrunk``.  Reports read these fields directly (``reports/report_folder.py``).
``Finding.key`` (check id, plus origin for exceptions or the spec's violation code) is what makes two findings
the same bug: the explorer reports one per key.
``Finding.to_json_dict()`` gives ``{"check", "key", "error", "blocks", "steps", "scenario"}``.

`Outcome` fields: ``scenario``, ``trace`` (list of events, possibly partial),
``error`` (text when the run raised, else None), ``findings`` (at most one per key),
``seconds``, ``record`` (what a real-DeepSpeed run showed: `findings.record.RunRecord`; ``skipped`` says why a
scenario could not be run at all), and what the worker or rank pool adds (its time, coverage, ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypedDict

from zerostate.model.designs import Design
from zerostate.model.events import Event
from zerostate.model.scenario import Scenario
from zerostate.findings.finding import Finding
from zerostate.findings.record import RunRecord



class TargetError(ValueError):
    """A target cannot be set up (unknown name or design, unsupported or uninstallable release, bad path)."""


@dataclass(frozen=True)
class RankSummary:
    """One rank of a rank pool's run: the train steps it reported and what it raised."""

    rank: int
    steps: int
    error: str | None = None


@dataclass
class Outcome:
    scenario: Scenario
    trace: list[Event] = field(default_factory=list)
    error: str | None = None
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    record: RunRecord | None = None
    """What the run showed (real DeepSpeed: `findings.record.RunRecord`); None for the model target and for a
    run that returned nothing (a hang, a dead worker, the executor's own failure)."""
    worker_seconds: float | None = None
    """The run's time inside the worker (the rest is the protocol and the judgement)."""
    cpu_seconds: float | None = None
    """The CPU time the run's worker processes spent on it (every rank's)."""
    oracle_seconds: float | None = None
    """... of that CPU time, the plain-PyTorch references' (every rank's)."""
    judge_seconds: float = 0.0
    """The caller's judgement of the run's record (the decider, the labels)."""
    coverage: Mapping[str, Sequence[int]] | None = None
    """Asked for (``measure_coverage``): per DeepSpeed file coverage.py traces, the arcs the run executed."""
    agreement: str | None = None
    """Why the run was not compared with the model design (a dimension the model does not represent)."""
    world_size: int = 1
    ranks: tuple[RankSummary, ...] = ()
    """A rank pool's run: each rank's part."""
    pool_restarted: str | None = None
    """Why the worker was started again around this run: a rank pool's ranks out of step after it, or a start
    that timed out or died before it (and was tried once more)."""

    @property
    def checks(self) -> list[str]:
        return [f.check for f in self.findings]

    @property
    def skipped(self) -> str | None:
        """Why the scenario could not run at all, or None."""
        return self.record.skipped if self.record is not None else None

    @property
    def steps(self) -> int:
        """The train steps that ran and were compared with the oracle."""
        return len(self.record.steps) if self.record is not None else 0


class Startup(TypedDict):
    """What starting one of a target's workers cost: its world size, the seconds from the process's start to its
    answer, and the DeepSpeed ops JIT-built meanwhile."""

    world_size: int
    seconds: float | None
    jit_builds: list[str]


@dataclass(frozen=True)
class Spent:
    """Where a target's time went, summed over every run and every worker start (`Target.spent`); seconds."""

    runs: int = 0
    run_seconds: float = 0.0
    """The caller's wall clock in ``run``: the worker's part, the protocol, the judgement."""
    worker_seconds: float = 0.0
    """The runs' wall clock inside their workers (a rank pool's: rank 0's)."""
    cpu_seconds: float = 0.0
    """The CPU time the runs' worker processes spent (every rank's): what the runs themselves cost."""
    oracle_seconds: float = 0.0
    """... of that CPU time, the plain-PyTorch references' (the oracle, and its counterfactuals when DeepSpeed differs;
    every rank's); the rest is DeepSpeed, the tracer and the comparisons."""
    judge_seconds: float = 0.0
    """The caller's judgement of the runs' records (the decider, the labels)."""
    starts: int = 0
    """Worker (rank pool) starts the caller waited for: a spare started ahead counts when it is taken."""
    start_waited: float = 0.0
    """Seconds the caller waited for a started worker's hello (a spare started ahead costs little of it)."""
    start_seconds: float = 0.0
    """The started workers' own start-up (process start to hello, each rank pool's rank 0): imports, warm-up."""
    forked_starts: int = 0
    """... of ``starts``, the workers (rank pools) forked from a warm fork server (`harness.forked`); the others
    were started as new processes (``--no-fork-server``, or a server that cannot fork)."""

    def __add__(self, other: Spent) -> Spent:
        return Spent(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(Spent)})

    def to_dict(self) -> dict[str, float]:
        return {f.name: round(getattr(self, f.name), 2) for f in fields(Spent)}


class Target(Protocol):
    """Everything the explorer, the cluster and the CLI ask of a target.  A target derives from it and inherits
    a no-op for each capability it lacks (a pure function such as the model is never started afresh, never
    restarted, has no workers to start ahead or measure), so no caller asks whether a target has one.  (The no-ops
    return None explicitly: a protocol method whose body is only a docstring is abstract to a type checker.)"""

    name: str
    """The kind: ``model`` or ``deepspeed``."""
    version: str | None
    """The DeepSpeed release it runs (None for the model)."""
    design: Design
    """The model design: the one run (model target) or the one its traces are compared with (deepspeed)."""
    examples: int = 0
    """Runs so far (a worker that ran some is started afresh before a lane)."""
    restarts: int = 0
    """How often a hang, a crash or ranks out of step forced a restart of its worker."""
    can_refresh: bool = False
    """Whether `fresh` starts a fresh worker; False: it does nothing, and a finding that does not reproduce
    at once is not replayed after its history (there is no fresh worker to replay it in)."""

    def run(self, scenario: Scenario) -> Outcome: ...

    def close(self) -> None:
        """Release the target's workers; nothing to release by default."""
        return None

    def fresh(self) -> None:
        """A fresh worker for the next run, nothing carried over from the runs before (`can_refresh`); by
        default there is no worker and nothing to do."""
        return None

    def prestart(self, world_size: int) -> None:
        """Start the workers of ``world_size``-rank scenarios ahead, in the background; by default none."""
        return None

    def measure_coverage(self, on: bool) -> None:
        """From the next run on, return (or stop returning) the DeepSpeed arcs each run executes; by default its
        runs execute no DeepSpeed code."""
        return None

    def startup(self) -> list[Startup]:
        """What starting the target's workers cost, per world size (reported as start-up); [] without workers."""
        return []

    def spent(self) -> Spent | None:
        """Where the target's time went so far (`Spent`); None where it is not measured (no worker processes)."""
        return None


def spec_findings(events: list[Event], scenario: Scenario, target: str, version: str | None,
                  coordinator: bool | None = None) -> list[Finding]:
    """Check the specs on a trace (`findings.decide.decide_trace`); one finding per violated spec: those of
    `specs_for_stage` (none at stage 0; coordinator-family specs at ZeRO-3 only, as the model checker does),
    or, with ``coordinator`` given, the hook specs and the coordinator's when it is True."""
    from zerostate.specs import specs_for, specs_for_stage
    from zerostate.findings.build import findings_of
    from zerostate.findings.decide import decide_trace
    chosen = specs_for_stage(scenario.stage)
    if coordinator is not None and chosen:  # the model target says whether its design has a coordinator
        chosen = specs_for("both" if coordinator else "hooks")
    return findings_of(decide_trace(events, scenario.stage, specs=chosen), scenario, events, target, version)


@dataclass(frozen=True)
class TargetKind:
    """One kind of target in the registry: its ``name``, a ``validate(**options)`` that raises
    `TargetError` for a bad configuration without starting anything, and the ``factory(**options)``
    that builds it (it may import heavy modules: it runs only after ``validate`` passed)."""

    name: str
    factory: Callable[..., Target]
    validate: Callable[..., None]


_KINDS: dict[str, TargetKind] = {}


def register(name: str, factory: Callable[..., Target], validate: Callable[..., None]) -> None:
    """Add a target kind (each kind's module registers itself; ``zerostate.targets`` imports them)."""
    _KINDS[name] = TargetKind(name, factory, validate)


def target_kinds() -> tuple[str, ...]:
    return tuple(_KINDS)


def known_design(design: str) -> None:
    """`TargetError` unless ``design`` names a model design."""
    from zerostate.model.designs import UnknownDesignError, get_design
    try:
        get_design(design)
    except UnknownDesignError as exc:
        raise TargetError(str(exc)) from None


def get_target(name: str, **options: Any) -> Target:
    """Build a target; every configuration error is raised here, before any scenario runs.

    ``options``: ``design``, ``deepspeed``, ``deepspeed_path``, ``world_size`` and the kind's own
    keywords; options left at None are not passed on."""
    kind = _KINDS.get(name)
    if kind is None:
        raise TargetError(f"unknown target {name!r}; known targets: {', '.join(_KINDS)}")
    options = {k: v for k, v in options.items() if v is not None}
    kind.validate(**options)
    return kind.factory(**options)


__all__ = ["Finding", "Outcome", "RankSummary", "Startup", "Target", "TargetError", "TargetKind", "get_target",
           "register", "spec_findings", "target_kinds"]
