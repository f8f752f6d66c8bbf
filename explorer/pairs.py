"""Pairwise completion: after the generated examples, the setup pairs none of them took, drawn and run.

A *pair* is two alternatives of two choice points (`choices.POINTS`: ZeRO stage x precision, offload x world
size, ...).  The generated sequence's draw rates leave pairs out by chance -- the default 200 examples hold
47 ZeRO-1 scenarios and none in bf16 --, and a combination no example ran is a part of DeepSpeed no example
judged, whatever the report says of the rest.  `complete` is the greedy step of AETG-style pairwise testing,
over the strategy itself: for the first pair (in `POINTS` order) still not taken, draw `DRAWS` scenarios
with that pair's two alternatives forced and every other point at its default rate (`forced`), keep the
draw that takes the most pairs still not taken, and go on until every pair is taken, found not drawable
(no draw took it: ZeRO-1 with a z3 leaf module, offload of parameters below ZeRO-3), or ``budget``
examples are made.  Deterministic given the examples run and the seed; it reads no outcome, so it favours
no finding and no known bug.

``engines_before`` counts as two alternatives here, none or some (its eight orders of engines each paired
with every other alternative would take more examples than the rest together).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from collections.abc import Iterable

from zerostate.model.scenario import Scenario

from zerostate.explorer.choices import DEFAULT, POINTS, SCALE, Taken, Weights, taken
from zerostate.explorer.generate import generated, seed_of

Pair = tuple[int, int, int, int]
"""(point i, its alternative a, point j > i, its alternative b), indices into `choices.POINTS`."""

DRAWS = 64
"""Scenarios drawn per pair before it is called not drawable: enough to meet a pair whose second alternative is
drawn only under another point's one-in-four alternative (fp32 accumulation exists only in bf16)."""
BUDGET_SHARE = 6
"""The completion's budget: one example per this many of the exploration's ``examples`` (`test_pairs` checks that
the default sequence's completion fits in it)."""

_COLLAPSED = "engines_before"
_INDEX = {p.name: k for k, p in enumerate(POINTS)}
LABELS: dict[str, tuple[str, ...]] = {
    "stage": ("3", "1", "2"), "checkpoint": ("none", "reentrant", "non-reentrant"),
    "persistence": ("0", "width", "100000"), "reduce_bucket": ("default", "small"),
    "precision": ("fp32", "bf16", "fp16"), "clipping": ("0", "1.0", "0.05"),
    "offload": ("none", "optimizer", "param", "both"), "outputs": ("tensor", "tuple", "dict"),
    "engines_before": ("none", "some"), "world": ("1", "2 (across-ranks option)", "several"),
}
"""How a pair names each point's alternatives in the report (`pair_name`); a point not here is off / on."""


def sizes() -> tuple[int, ...]:
    return tuple(2 if p.name == _COLLAPSED else len(p.default) for p in POINTS)


def alternatives(sc: Scenario) -> tuple[Taken, ...]:
    """`choices.taken`, with ``engines_before`` as none (0) or some (1)."""
    t = list(taken(sc))
    k = _INDEX[_COLLAPSED]
    t[k] = frozenset(min(x, 1) for x in t[k])
    return tuple(t)


def pairs_of(sc: Scenario) -> frozenset[Pair]:
    t = alternatives(sc)
    return frozenset((i, a, j, b) for i in range(len(t)) for j in range(i + 1, len(t)) for a in t[i] for b in t[j])


def all_pairs() -> list[Pair]:
    n = sizes()
    return [(i, a, j, b) for i in range(len(n)) for j in range(i + 1, len(n)) for a in range(n[i]) for b in range(n[j])]


def pair_name(pair: Pair) -> str:
    i, a, j, b = pair
    return f"{_alt(i, a)} x {_alt(j, b)}"


def _alt(k: int, a: int) -> str:
    name = POINTS[k].name
    labels = LABELS.get(name, ("off", "on"))
    return f"{name.removeprefix('extra:')}={labels[a] if a < len(labels) else a}"


def forced(pair: Pair) -> Weights:
    """The default rates with the pair's two points drawn only at its two alternatives (``engines_before``
    "some": its eight orders at equal rates)."""
    i, a, j, b = pair
    table = [list(w) for w in DEFAULT.table]
    for k, v in ((i, a), (j, b)):
        if POINTS[k].name == _COLLAPSED:
            table[k] = [0] + [SCALE] * (len(table[k]) - 1) if v else [SCALE] + [0] * (len(table[k]) - 1)
        else:
            table[k] = [SCALE if x == v else 0 for x in range(len(table[k]))]
    return Weights(tuple(tuple(w) for w in table))


def _seed(seed: int | None, pair: Pair) -> int:
    return zlib.crc32(repr((seed_of(seed), pair)).encode())


@dataclass
class Completion:
    """What `complete` made of the examples run."""

    examples: list[Scenario] = field(default_factory=list)
    """The scenarios to run, in order."""
    missing: int = 0
    """Pairs the examples run did not take (drawable or not)."""
    not_drawable: list[Pair] = field(default_factory=list)
    """Pairs no draw with both alternatives forced took."""
    left: list[Pair] = field(default_factory=list)
    """Pairs still not taken when the budget was spent (drawable or not: not tried)."""

    def to_dict(self) -> dict[str, object]:
        return {"missing_after_generation": self.missing, "examples": len(self.examples),
                "not_drawable": [pair_name(p) for p in self.not_drawable],
                "left": [pair_name(p) for p in self.left]}


def complete(ran: Iterable[Scenario], budget: int, seed: int | None) -> Completion:
    """The completion of ``ran`` (module docstring): at most ``budget`` new scenarios."""
    ran = list(ran)
    seen = {sc.to_json(None) for sc in ran}
    covered: set[Pair] = set().union(*map(pairs_of, ran))
    missing = [p for p in all_pairs() if p not in covered]
    out = Completion(missing=len(missing))
    todo = list(missing)
    while todo and len(out.examples) < budget:
        pair = todo[0]
        best = draw_for(pair, seed, seen, set(todo))
        if best is None:
            out.not_drawable.append(pair)
            todo.pop(0)
            continue
        out.examples.append(best)
        seen.add(best.to_json(None))
        took = pairs_of(best)
        todo = [p for p in todo if p not in took]
    out.left = todo
    return out


def draw_for(pair: Pair, seed: int | None, seen: set[str] | frozenset[str] = frozenset(),
             left: set[Pair] | frozenset[Pair] = frozenset()) -> Scenario | None:
    """Of `DRAWS` scenarios drawn with ``pair`` forced, one not in ``seen`` (scenario JSON) that takes it and
    the most of ``left`` (the first such); None: none took it."""
    from zerostate.explorer.strategies import scenarios
    best, gain = None, -1
    for sc in generated(scenarios(weights=forced(pair)), DRAWS, _seed(seed, pair)):
        got = pairs_of(sc)
        if pair not in got or sc.to_json(None) in seen:
            continue
        if len(got & left) > gain:
            best, gain = sc, len(got & left)
    return best


def budget_for(examples: int) -> int:
    return examples // BUDGET_SHARE


__all__ = ["BUDGET_SHARE", "Completion", "DRAWS", "LABELS", "Pair", "all_pairs", "alternatives", "budget_for",
           "complete", "draw_for", "forced", "pair_name", "pairs_of", "sizes"]
