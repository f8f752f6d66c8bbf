"""The strategy's choice points a steered exploration reweighs, and which alternatives a scenario shows it took.

Each `Point` names one draw of `strategies.scenarios` whose draw rate is a table of small integers today
(``sampled_from`` of repeated values, a boolean): its ``default`` counts are today's rates, in the
alternatives' draw order (the first alternative is the one Hypothesis shrinks to).  `pick` is how
`strategies` draws one: with no weights, or with weights in the proportions of ``default``, it returns the
strategy's own draw unchanged -- so the default sequence is the one without steering, draw for draw --,
otherwise a ``sampled_from`` of the alternatives repeated by their weights (same order: shrinking goes
the same way).  `taken` reads back from a finished scenario which alternatives it took: what the
scheduler credits (`steering_schedule`); a draw that a scenario cannot show (offload at stage 0, an option that did
not apply) credits nothing.

Pure: no Hypothesis import at module level but the strategies' own (`pick` builds one).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any
from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from zerostate.model.scenario import (Checkpoint, Family, Gather, Offload, Optimizer, Outputs, Precision, Scenario,
                                      Scheduler)

Taken = frozenset[int]
"""Indices of the alternatives a scenario shows it took at one point (empty: it cannot tell)."""


@dataclass(frozen=True)
class Point:
    name: str
    default: tuple[int, ...]
    """Today's draw rate of each alternative, as counts (``(7, 1)``: one draw in eight)."""
    taken: Callable[[Scenario], Taken]


def _one(i: int | None) -> Taken:
    return frozenset() if i is None else frozenset((i,))


def _flag(on: bool) -> Taken:
    return frozenset((int(on),))


def _index(value: Any, among: Sequence[Any]) -> Taken:
    return _one(list(among).index(value) if value in among else None)


_CHECKPOINTS = (Checkpoint.NONE, Checkpoint.REENTRANT, Checkpoint.NON_REENTRANT)
_PRECISIONS = (Precision.FP32, Precision.BF16, Precision.FP16)
_OFFLOADS = (Offload.NONE, Offload.OPTIMIZER, Offload.PARAM, Offload.BOTH)
_OUTPUTS = (Outputs.TENSOR, Outputs.TUPLE, Outputs.DICT)
_ENGINES_BEFORE = ((), (3,), (1,), (2,), (3, 3), (3, 1), (3, 2), (1, 3), (2, 3))
_BLOCKS_FAMILY = Family.BLOCKS
_SCHEDULERS = (Scheduler.NONE, Scheduler.INITIALIZE, Scheduler.USER)
_GATHERS = (Gather.NONE, Gather.READ, Gather.EDIT)


def _extra(name: str, shows: Callable[[Scenario], bool | None], default: tuple[int, int] = (3, 1)) -> Point:
    """One option of `strategies.EXTRAS`: ``shows(sc)`` is whether it was on, None where it did not apply."""
    def taken(sc: Scenario) -> Taken:
        on = shows(sc)
        return frozenset() if on is None else _flag(on)
    return Point(f"extra:{name}", default, taken)


def _persistence(sc: Scenario) -> Taken:
    return _one(0 if sc.persistence_threshold == 0 else 2 if sc.persistence_threshold == 100_000 else 1)


def _reduce_bucket(sc: Scenario) -> Taken:
    """DeepSpeed's default, small (two weights' worth: ``2 * width**2`` of the drawn width), or exactly one Linear
    weight of the scenario (``width**2``: a gradient that fills an emptied bucket to its size; completion only)."""
    if sc.reduce_bucket_size == sc.width * sc.width:
        return _one(2)
    return _flag(sc.reduce_bucket_size != 500_000_000)


def _world(sc: Scenario) -> Taken:
    """(world size 1, across-ranks options ignored), (several ranks only with them), (several ranks, four with
    them): what the world size and an across-ranks option show of the draw (`strategies._world_size`); a
    world-size-1 scenario without one cannot tell the first two apart."""
    from zerostate.explorer.strategies import across_ranks
    across = across_ranks(sc)
    if sc.world_size == 4 or (sc.world_size == 2 and not across):
        return _one(2)
    if sc.world_size == 2:
        return _one(1)
    return _one(0) if across else frozenset()


POINTS: tuple[Point, ...] = (
    Point("stage", (1, 1, 1), lambda sc: _index(sc.stage, (3, 1, 2))),
    Point("checkpoint", (1, 1, 1), lambda sc: frozenset(_CHECKPOINTS.index(b.checkpoint) for b in sc.blocks)),
    Point("leaf", (3, 1), lambda sc: frozenset(int(b.leaf) for b in sc.blocks)
          if sc.stage == 3 and sc.family is _BLOCKS_FAMILY else frozenset()),
    Point("persistence", (1, 1, 1), _persistence),
    Point("reduce_bucket", (1, 1, 0), _reduce_bucket),
    Point("llama", (7, 1), lambda sc: _flag(sc.family is not _BLOCKS_FAMILY)),
    Point("precision", (2, 1, 1), lambda sc: _index(sc.precision, _PRECISIONS)),
    Point("fp32_grad_accum", (1, 1), lambda sc: _flag(sc.fp32_grad_accum)
          if sc.precision is Precision.BF16 and sc.stage != 0 else frozenset()),
    Point("clipping", (1, 1, 1), lambda sc: _index(sc.gradient_clipping, (0.0, 1.0, 0.05))),
    Point("offload", (1, 1, 1, 1), lambda sc: _index(sc.offload, _OFFLOADS) if sc.stage != 0 else frozenset()),
    Point("outputs", (1, 1, 1), lambda sc: _index(sc.outputs, _OUTPUTS)
          if sc.family is _BLOCKS_FAMILY else frozenset()),
    Point("retain", (7, 1), lambda sc: frozenset(int(m.retain) for s in sc.steps if not s.idle for m in s.micro)),
    Point("idle", (7, 1), lambda sc: _flag(any(s.idle for s in sc.steps)) if len(sc.steps) > 1 else frozenset()),
    Point("engines_before", (56,) + (1,) * 8, lambda sc: _index(tuple(sc.engines_before), _ENGINES_BEFORE)),
    _extra("gas3", lambda sc: sc.gas == 3),
    _extra("manual_boundary", lambda sc: sc.manual_boundary),
    _extra("contiguous_gradients", lambda sc: not sc.contiguous_gradients),
    _extra("overlap_comm", lambda sc: None if sc.stage == 0 else sc.overlap_comm is not None),
    _extra("all_reduce_fetch", lambda sc: sc.all_reduce_fetch if sc.stage == 3 else None),
    _extra("late_module", lambda sc: sc.late_module if sc.family is _BLOCKS_FAMILY else None),
    _extra("stage0", lambda sc: sc.stage == 0 if sc.stage != 3 else None),
    _extra("zero_init", lambda sc: sc.zero_init if sc.stage == 3 else sc.empty_param
           if sc.family is _BLOCKS_FAMILY else None),
    _extra("config_adam", lambda sc: sc.optimizer is Optimizer.CONFIG_ADAM, default=(1, 1)),
    _extra("reduce_scatter", lambda sc: None if sc.stage == 0 else not sc.reduce_scatter, default=(1, 0)),
    Point("world", (2, 5, 1), _world),
    # completion and goals only (rate 0 in the generated sequence, which they leave as it was)
    Point("scheduler", (1, 0, 0), lambda sc: _index(sc.scheduler, _SCHEDULERS)),
    Point("decay_groups", (1, 0), lambda sc: _flag(sc.decay_groups)),
    Point("unused_in_step", (1, 0), lambda sc: _flag(any(s.unused for s in sc.steps))
          if sc.family is _BLOCKS_FAMILY else frozenset()),
    Point("gathered", (1, 0, 0), lambda sc: frozenset(_GATHERS.index(s.gather) for s in sc.steps)),
    Point("gathered_inside", (1, 0), lambda sc: frozenset(int(s.gather_inside) for s in sc.steps
                                                          if s.gather is not Gather.NONE)),
    Point("resume", (1, 0), lambda sc: _flag(any(s.resume for s in sc.steps))),
    Point("zero_grad", (1, 0), lambda sc: _flag(any(m.zero_grad for _, _, m in sc.micro_steps()))
          if sc.gas == 1 else frozenset()),
)
GOALS_ONLY = frozenset({"scheduler", "decay_groups", "unused_in_step", "gathered", "gathered_inside", "resume",
                        "zero_grad"})
"""Points the pairwise completion leaves to the goals round (`goals.SURVEY`): the dimensions added after the
completion's pairs were laid out.  Last in `POINTS`, so the pairs' indices of every other point stay as they were."""
PAIRED: tuple[Point, ...] = tuple(p for p in POINTS if p.name not in GOALS_ONLY)
"""The points the pairwise completion pairs (`pairs`): `POINTS` less `GOALS_ONLY`, in the same order and indices."""
assert POINTS[:len(PAIRED)] == PAIRED, "GOALS_ONLY points come last in POINTS"
BY_NAME = {p.name: p for p in POINTS}
COMPLETION_ONLY = frozenset(p.name for p in POINTS if 0 in p.default)
"""Points with an alternative at rate 0: the generated sequence never draws it, only the pairwise completion's
forced weights do (`pairs`)."""

SCALE = 16
"""A schedule's weights are counts in units of 1/SCALE of a default count: room to halve any rate exactly."""


@dataclass(frozen=True)
class Weights:
    """One schedule: per choice point (`POINTS` order), the weight of each alternative."""

    table: tuple[tuple[int, ...], ...]

    def of(self, name: str) -> tuple[int, ...]:
        return self.table[[p.name for p in POINTS].index(name)]

    def to_dict(self) -> dict[str, list[int]]:
        return {p.name: list(w) for p, w in zip(POINTS, self.table, strict=True)}

    @classmethod
    def from_dict(cls, d: dict[str, list[int]]) -> Weights:
        return cls(tuple(tuple(int(x) for x in d[p.name]) for p in POINTS))


DEFAULT = Weights(tuple(tuple(c * SCALE for c in p.default) for p in POINTS))
"""Today's rates: the schedule of round 0 (and of every round of an unsteered run)."""


def forcing(need: dict[int, frozenset[int]]) -> Weights:
    """The default rates with each point of ``need`` (by index) drawn only at its alternatives there, at equal rates."""
    table = [list(w) for w in DEFAULT.table]
    for k, alts in need.items():
        table[k] = [SCALE if x in alts else 0 for x in range(len(table[k]))]
    return Weights(tuple(tuple(w) for w in table))


def _reduced(counts: Sequence[int]) -> tuple[int, ...]:
    g = 0
    for c in counts:
        g = gcd(g, c)
    return tuple(c // g for c in counts) if g else tuple(counts)


def pick(weights: Weights | None, name: str, own: Any, values: Sequence[Any],
         among: Sequence[int] | None = None) -> Any:
    """The strategy that draws point ``name``: ``own`` (the strategy's own draw) unless ``weights`` moved the
    point's rates (over the alternatives ``among``, all by default), then a ``sampled_from`` of ``values``
    (the alternatives, in `Point` order) each repeated by its weight."""
    if weights is None or len(values) != len(BY_NAME[name].default):  # a caller's own alternatives: not steered
        return own
    idx = list(among) if among is not None else list(range(len(values)))
    point = BY_NAME[name]
    w = weights.of(name)
    if _reduced([w[i] for i in idx]) == _reduced([point.default[i] for i in idx]):
        return own
    counts = _reduced([w[i] for i in idx])
    if not any(counts):  # weight only on alternatives this draw does not offer (param offload at ZeRO-1/2)
        return own
    return st.sampled_from(tuple(v for i, c in zip(idx, counts, strict=True) for v in (values[i],) * c))


def taken(sc: Scenario) -> tuple[Taken, ...]:
    """The alternatives ``sc`` shows it took, per point (`POINTS` order)."""
    return tuple(p.taken(sc) for p in POINTS)


__all__ = ["BY_NAME", "COMPLETION_ONLY", "DEFAULT", "GOALS_ONLY", "PAIRED", "POINTS", "SCALE", "Point", "Taken",
           "Weights", "forcing", "pick", "taken"]
