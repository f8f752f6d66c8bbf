"""Exhaustive model check: every scenario up to a bound, every interleaving, every design.

`Bound` says which scenarios to enumerate (default: 1-3 blocks, every
checkpoint mode, each block trainable or frozen-norm, with and without a fused
head, 1-2 micro-steps of every backward kind, ZeRO-3; coordinator specs on the
part of it with at most 2 blocks and 1 micro-step).  Scenarios are
enumerated smallest first, so the first counterexample found for a spec is a
smallest one.  For each (design, scenario) the reachable state graph is built
with the spec monitors inside it (`explore.state_graph`); hook-family specs use
the driver DAG without module-hook nodes (gradient hooks of one graph task in one
order: `explore.order_hooks_within_tasks`), coordinator-family specs the serial
DAG (every coordinator event, gradient hooks right after their module's backward:
`driver.segments`); ``generated_tests/test_checker.py`` and
``test_coordinator_model.py`` check both reductions against every interleaving.

Work is spread over processes (``jobs``); results are merged in enumeration order,
so the answer does not depend on ``jobs``.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

from zerostate.model.designs import Design, get_design
from zerostate.model.driver import CoordinatorMode
from zerostate.model.events import Event
from zerostate.model.explore import StateGraph, state_graph
from zerostate.model.failure import Violation
from zerostate.model.network import Network
from zerostate.model.scenario import BackwardKind, Block, Checkpoint, MicroStep, ParamKind, Scenario, TrainStep
from zerostate.specs import SPECS, Spec, specs_for

BLOCK_KINDS = {
    "trainable": (ParamKind.TRAINABLE, ParamKind.TRAINABLE),
    "frozen": (ParamKind.FROZEN, ParamKind.TRAINABLE),  # seed 002's shape: frozen norm, trainable lin
    "all-frozen": (ParamKind.FROZEN, ParamKind.FROZEN),
    "unused": (ParamKind.TRAINABLE, ParamKind.UNUSED),
}


@dataclass(frozen=True)
class Bound:
    max_blocks: int = 3
    checkpoints: tuple[Checkpoint, ...] = (Checkpoint.NONE, Checkpoint.REENTRANT, Checkpoint.NON_REENTRANT)
    block_kinds: tuple[str, ...] = ("trainable", "frozen")
    backwards: tuple[BackwardKind, ...] = (BackwardKind.ENGINE, BackwardKind.TORCH, BackwardKind.NONSCALAR)
    max_micro_steps: int = 2
    fused_head: tuple[bool, ...] = (False, True)
    stages: tuple[int, ...] = (3,)
    input_requires_grad: tuple[bool, ...] = (True, False)
    """Whether the network input requires grad: without it a reentrant block's parameters get no
    gradient, and a module fed such an input never runs its post-backward hook."""
    coordinator_max_blocks: int = 2
    """Coordinator specs track every parameter of every module, so their state graphs are far
    larger: they are checked on the scenarios within this smaller bound (seed 002 needs 1 block)."""
    coordinator_max_micro_steps: int = 1

    def covers_coordinator(self, sc: Scenario) -> bool:
        return len(sc.blocks) <= self.coordinator_max_blocks and sc.num_micro_steps <= self.coordinator_max_micro_steps

    def scenarios(self) -> Iterator[Scenario]:
        """Smallest first: blocks, then micro-steps, then the rest in declaration order."""
        for n in range(1, self.max_blocks + 1):
            for m in range(1, self.max_micro_steps + 1):
                for stage in self.stages:
                    for head, in_rg in itertools.product(self.fused_head, self.input_requires_grad):
                        for combo in itertools.product(itertools.product(self.checkpoints, self.block_kinds),
                                                       repeat=n):
                            blocks = tuple(Block(ck, *BLOCK_KINDS[kind]) for ck, kind in combo)
                            for kinds in itertools.product(self.backwards, repeat=m):
                                sc = Scenario(blocks=blocks, stage=stage, fused_head=head,
                                              input_requires_grad=in_rg,
                                              steps=(TrainStep(tuple(MicroStep(k) for k in kinds)),))
                                if Network(sc).loss_requires_grad:
                                    yield sc


@dataclass
class DesignResult:
    """One design over the bound: the specs ``checked``, and per violated spec its first (smallest)
    counterexample -- the scenario, the event sequence and the monitor's `Violation` on it."""

    design: str
    expected_correct: bool
    judged: tuple[str, ...]
    checked: tuple[str, ...] = ()
    violations: dict[str, Violation] = field(default_factory=dict)
    counterexamples: dict[str, tuple[Scenario, list[Event]]] = field(default_factory=dict)
    states: int = 0
    transitions: int = 0
    scenarios: int = 0
    seconds: float = 0.0

    def holds(self, spec_id: str) -> bool:
        return spec_id not in self.violations

    @property
    def ok(self) -> bool:
        """Holds on every spec it is judged on (its family's)."""
        return all(self.holds(s) for s in self.judged)


@dataclass
class CheckResult:
    bound: Bound
    designs: dict[str, DesignResult]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.designs.values() if d.expected_correct)

    def to_json(self) -> dict[str, Any]:
        return {"designs": {
            name: {"specs": {sid: {"holds": d.holds(sid),
                                   "counterexample": d.counterexamples[sid][0].to_dict() if sid in d.violations
                                   else None,
                                   **({"message": d.violations[sid].message} if sid in d.violations else {})}
                             for sid in d.checked},
                   "states": d.states, "transitions": d.transitions, "scenarios": d.scenarios,
                   "seconds": round(d.seconds, 3), "expected_correct": d.expected_correct,
                   "judged_on": list(d.judged)}
            for name, d in self.designs.items()},
            "seconds": round(self.seconds, 3), "ok": self.ok}


def _specs_by_family(spec_ids: Sequence[str] | None) -> tuple[list[Spec], list[Spec]]:
    chosen = [SPECS[s] for s in spec_ids] if spec_ids else list(SPECS.values())
    return ([s for s in chosen if s.family == "hooks"], [s for s in chosen if s.family == "coordinator"])


def judged_specs(design: Design) -> tuple[str, ...]:
    return tuple(s.id for s in specs_for(design.family))


def canonical(sc: Scenario) -> Scenario:
    """The representative the checker computes for ``sc``.

    ``out.backward(gradient)`` and ``loss.backward()`` are both PyTorch-style:
    no design distinguishes them (they differ only in the ``note`` of
    ``USER_BACKWARD_START``; ``generated_tests/test_checker.py`` checks the traces
    are otherwise identical), so a non-scalar micro-step is computed as a
    ``torch`` one and its result reported for both.
    """
    steps = tuple(replace(s, micro=tuple(MicroStep(BackwardKind.TORCH) if m.backward is BackwardKind.NONSCALAR
                                         else m for m in s.micro)) for s in sc.steps)
    return sc.with_(steps=steps)


_Failures: TypeAlias = dict[str, tuple[Violation, list[Event]]]
_Summary: TypeAlias = tuple[int, int, _Failures]
"""One design on one scenario: states, transitions, and per violated spec its violation and events."""
_Chunk: TypeAlias = tuple[tuple[str, ...], list[Scenario], tuple[tuple[str, ...], ...], Bound]
"""A worker's job: design names, scenarios, per design the spec ids still open, the bound."""


def _check_chunk(args: _Chunk) -> list[list[_Summary]]:
    """Worker: for each scenario, the state graphs of every design; per-(scenario, design) summaries."""
    names, scenarios, per_design_ids, bound = args
    designs = [get_design(n) for n in names]
    by_family = [_specs_by_family(ids) for ids in per_design_ids]
    out: list[list[_Summary]] = []
    for sc in scenarios:
        row: list[_Summary] = []
        for design, (hook_specs, coord_specs) in zip(designs, by_family, strict=True):
            states = transitions = 0
            failures: _Failures = {}
            groups: list[tuple[list[Spec], CoordinatorMode]] = [(hook_specs, False)]
            if (coord_specs and sc.stage == 3 and bound.covers_coordinator(sc)
                    and design.coordinator.name != "none"):
                groups.append((coord_specs, "serial"))
            for specs, coord in groups:
                if not specs:
                    continue
                g = state_graph(design, sc, specs, coordinator=coord)
                states += g.states
                transitions += g.transitions
                for sid, v in g.violations.items():
                    failures[sid] = (v, g.counterexamples[sid])
            row.append((states, transitions, failures))
        out.append(row)
    return out


def check(design_names: Sequence[str], bound: Bound = Bound(), spec_ids: Sequence[str] | None = None,
          jobs: int | None = None, all_specs: bool = False) -> CheckResult:
    """Check every named design over every scenario of ``bound``.  Unknown names raise first.

    Each design is checked on the specs it is judged on (its family's: `judged_specs`) --
    a coordinator-era design shares ``ds-0.18.7``'s hook half, checked under that name, and a
    hook-era design pairs with the coordinator of its release, which ``ds-0.19.2`` covers.
    ``all_specs=True`` checks every design on every spec (slower; informative only).
    """
    designs = [get_design(n) for n in design_names]  # UnknownDesignError before any work
    hook_specs, coord_specs = _specs_by_family(spec_ids)
    chosen = [s.id for s in (*hook_specs, *coord_specs)]
    per_design_ids = tuple(tuple(s for s in chosen if all_specs or s in judged_specs(d)) for d in designs)
    scenarios = list(bound.scenarios())
    jobs = jobs or min(os.cpu_count() or 1, 8)
    t0 = time.perf_counter()
    results = {d.name: DesignResult(d.name, d.expected_correct,
                                    tuple(s for s in judged_specs(d) if s in per_design_ids[i]), per_design_ids[i])
               for i, d in enumerate(designs)}
    names = tuple(d.name for d in designs)
    pool = ProcessPoolExecutor(jobs) if jobs > 1 else None
    try:
        # Waves of equal size, smallest first.  A spec already violated by a design needs no more
        # scenarios (the first counterexample is a smallest one), so later waves drop it.
        for _, same_size in itertools.groupby(scenarios, key=lambda sc: (len(sc.blocks), sc.num_micro_steps)):
            wave = list(same_size)
            open_ids = tuple(tuple(sid for sid in per_design_ids[i] if results[n].holds(sid))
                             for i, n in enumerate(names))
            if not any(open_ids):
                break
            reps = list(dict.fromkeys(canonical(sc) for sc in wave))
            chunk = max(1, len(reps) // (jobs * 4))
            pieces = [reps[i:i + chunk] for i in range(0, len(reps), chunk)]
            args: list[_Chunk] = [(names, p, open_ids, bound) for p in pieces]
            mapped = list(pool.map(_check_chunk, args)) if pool else [_check_chunk(a) for a in args]
            by_rep = {sc: row for piece, rows in zip(pieces, mapped, strict=True)
                      for sc, row in zip(piece, rows, strict=True)}
            for sc in wave:  # enumeration order: the first failure recorded is a smallest one
                for di, n in enumerate(names):
                    res = results[n]
                    states, transitions, failures = by_rep[canonical(sc)][di]
                    res.states += states
                    res.transitions += transitions
                    res.scenarios += 1
                    for sid, (v, events) in failures.items():
                        if res.holds(sid):
                            res.violations[sid] = v
                            res.counterexamples[sid] = (sc, events)
    finally:
        if pool:
            pool.shutdown()
    elapsed = time.perf_counter() - t0
    _apportion_seconds(results, elapsed)
    return CheckResult(bound, results, elapsed)


def _apportion_seconds(results: dict[str, DesignResult], elapsed: float) -> None:
    """Designs are checked interleaved (scenario by scenario); split wall time by states explored."""
    total = sum(r.states for r in results.values()) or 1
    for r in results.values():
        r.seconds = elapsed * r.states / total


def counterexample_graph(design_name: str, scenario: Scenario, spec_id: str) -> StateGraph | None:
    """The reachable state graph (networkx) of one counterexample scenario, for pictures."""
    spec = SPECS[spec_id]
    design = get_design(design_name)
    return state_graph(design, scenario, [spec], keep_graph=True,
                       coordinator="serial" if spec.family == "coordinator" else False).graph


__all__ = ["BLOCK_KINDS", "Bound", "CheckResult", "DesignResult", "check",
           "counterexample_graph", "judged_specs"]
