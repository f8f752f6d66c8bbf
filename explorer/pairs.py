"""Pairwise completion: after the generated examples, the setup pairs none of them took, drawn and run.

A *pair* is two alternatives of two choice points (`choices.PAIRED`: ZeRO stage x precision, offload x world size,
...).  The generated sequence's draw rates leave pairs out by chance -- the default budget once held no ZeRO-1
scenario in bf16 (docs/deepspeed-target.md, pairwise completion) --, and a combination no example ran is a part of
DeepSpeed no example judged, whatever the report says of the rest.  `complete` is the greedy step of AETG-style
pairwise testing, over the strategy itself: for the first pair (in `POINTS` order) still not taken, draw `DRAWS`
scenarios with that pair's two alternatives forced and every other point at its default rate (`forced`), keep the
draw that takes the most pairs still not taken, and go on until every pair is taken, found not drawable (no draw
took it), or ``budget`` examples are made.  A pair the strategy's structure rules out (ZeRO-1 with a z3 leaf module,
offload of parameters below ZeRO-3: `drawable.SHOWS_ONLY`) is skipped undrawn.
Deterministic given the examples run and the seed.

Of an example's outcome it reads one thing: whether the run reached its end (`ran_through`).  A run that ended on
an exception (DeepSpeed's, a hang, a crash, the tool's own) did not run the rest of its scenario -- a known
crash at a checkpoint round trip hides every later step --, so a pair taken only by such runs counts as not
taken, and `exploration` completes in `ROUNDS` rounds.  The first reads no outcome: it completes the pairs no
generated scenario takes, so it is drawn and run while the generated lanes still run.  The second, after every
generated and first-round run, redraws the pairs taken only by runs that ended early (another draw of the same
64; the scenarios run are never drawn again).  It reads no finding, so it favours no check and no known bug.

``engines_before`` counts as two alternatives here, none or some (its eight orders of engines each paired
with every other alternative would take more examples than the rest together).

One point is *derived*, not drawn: ``wrapper``, the optimizer wrapper DeepSpeed builds around the optimizer
(`WRAPPER`), which no single choice decides -- ZeRO-1 bf16 with fp32 gradient accumulation and no offload
builds ``BF16_Optimizer``, stage 0 builds ``FP16_Optimizer`` or none --, so pairs of points alone can leave a
wrapper stepping under none of the other alternatives (clipping, several steps, ...).  Its pairs are drawn by
forcing the points that select it (`Derived.selects`).  So is ``z3_reduce``, the route by which ZeRO-3 reduces a
gradient bucket (`Z3_REDUCE`: its contiguous buffer only with ``contiguous_gradients`` on and ``reduce_scatter``
off), paired with the bucket sizes that decide how that buffer fills.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from collections.abc import Callable, Generator, Iterable, Sequence

from zerostate.model.scenario import Scenario

from zerostate.explorer.choices import PAIRED as POINTS, Taken, Weights, forcing, taken
from zerostate.explorer.drawable import undrawable
from zerostate.explorer.generate import generated, seed_of

Pair = tuple[int, int, int, int]
"""(point i, its alternative a, point j > i, its alternative b), indices into `choices.POINTS`."""

DRAWS = 64
"""Scenarios drawn per pair before it is called not drawable: enough to meet a pair whose second alternative is
drawn only under another point's one-in-four alternative (fp32 accumulation exists only in bf16)."""
BUDGET_SHARE = 4
"""The completion's budget: one example per this many of the exploration's ``examples`` (`test_pairs` checks that
the default sequence's completion fits in it)."""

_COLLAPSED = "engines_before"
_INDEX = {p.name: k for k, p in enumerate(POINTS)}


@dataclass(frozen=True)
class Derived:
    """A point read from the scenario, not drawn: ``of`` its alternative; ``selects[a]``: for alternative
    ``a``, the drawn points' alternatives (`POINTS` names) a draw must take to show it."""

    name: str
    labels: tuple[str, ...]
    of: Callable[[Scenario], int]
    selects: tuple[dict[str, frozenset[int]], ...]


def _wrapper(sc: Scenario) -> int:
    """DeepSpeed's ``_do_optimizer_sanity_check``: ZeRO-1 + bf16 + fp32 accumulation without offload wraps in
    BF16_Optimizer; stage 0 in FP16_Optimizer (fp16, bf16) or nothing (fp32); else the ZeRO optimizer."""
    if sc.stage == 0:
        return 2 if sc.fp16_optimizer else 3
    return 1 if sc.bf16_optimizer else 0


_ZERO12, _ON, _OFF = frozenset((1, 2)), frozenset((1,)), frozenset((0,))
WRAPPER = Derived("wrapper", ("zero", "BF16_Optimizer", "FP16_Optimizer", "none"), _wrapper, (
    {"extra:stage0": _OFF},
    {"stage": frozenset((1,)), "precision": frozenset((1,)), "fp32_grad_accum": _ON, "offload": _OFF,
     "extra:stage0": _OFF},
    {"stage": _ZERO12, "precision": frozenset((1, 2)), "extra:stage0": _ON},
    {"stage": _ZERO12, "precision": _OFF, "extra:stage0": _ON}))


def _z3_reduce(sc: Scenario) -> int:
    """ZeRO-3's ``__reduce_and_partition_ipg_grads``: with ``contiguous_gradients`` on and ``reduce_scatter`` off it
    reduces the bucket's contiguous buffer (into which `__add_grad_to_ipg_bucket` copied each gradient that fit),
    else each gradient tensor itself; below ZeRO-3 neither."""
    if sc.stage != 3:
        return 0
    return 2 if sc.contiguous_gradients and not sc.reduce_scatter else 1


Z3_REDUCE = Derived("z3_reduce", ("not ZeRO-3", "per tensor", "contiguous buffer"), _z3_reduce, (
    {"stage": _ZERO12},
    {"stage": frozenset((0,)), "extra:reduce_scatter": _OFF},
    {"stage": frozenset((0,)), "extra:reduce_scatter": _ON, "extra:contiguous_gradients": _OFF}))
DERIVED: tuple[Derived, ...] = (WRAPPER, Z3_REDUCE)
"""Derived points, indexed after `POINTS` in a `Pair`."""
LABELS: dict[str, tuple[str, ...]] = {
    "stage": ("3", "1", "2"), "checkpoint": ("none", "reentrant", "non-reentrant"),
    "persistence": ("0", "width", "100000"), "reduce_bucket": ("default", "small", "one weight"),
    "precision": ("fp32", "bf16", "fp16"), "clipping": ("0", "1.0", "0.05"),
    "offload": ("none", "optimizer", "param", "both"), "outputs": ("tensor", "tuple", "dict"),
    "engines_before": ("none", "some"), "world": ("1", "2 (across-ranks option)", "several"),
}
"""How a pair names each point's alternatives in the report (`pair_name`); a point not here is off / on."""


def sizes() -> tuple[int, ...]:
    return tuple(2 if p.name == _COLLAPSED else len(p.default) for p in POINTS) + tuple(len(d.labels) for d in DERIVED)


def alternatives(sc: Scenario) -> tuple[Taken, ...]:
    """`choices.taken`, with ``engines_before`` as none (0) or some (1), then the `DERIVED` points'."""
    t = list(taken(sc))[:len(POINTS)]
    k = _INDEX[_COLLAPSED]
    t[k] = frozenset(min(x, 1) for x in t[k])
    return tuple(t) + tuple(frozenset((d.of(sc),)) for d in DERIVED)


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
    if k >= len(POINTS):
        d = DERIVED[k - len(POINTS)]
        return f"{d.name}={d.labels[a]}"
    name = POINTS[k].name
    labels = LABELS.get(name, ("off", "on"))
    return f"{name.removeprefix('extra:')}={labels[a] if a < len(labels) else a}"


def _selects(k: int, a: int) -> dict[int, frozenset[int]]:
    """The drawn points' alternatives (by index) that alternative ``a`` of point ``k`` needs."""
    if k >= len(POINTS):
        return {_INDEX[name]: alts for name, alts in DERIVED[k - len(POINTS)].selects[a].items()}
    if POINTS[k].name == _COLLAPSED:
        return {k: frozenset(range(1, len(POINTS[k].default))) if a else frozenset((0,))}
    return {k: frozenset((a,))}


def forced(pair: Pair) -> Weights | None:
    """The default rates with the pair's two points drawn only at its two alternatives (``engines_before``
    "some": its eight orders at equal rates; a derived point: the alternatives that select it); None when the
    two need different alternatives of one point (not drawable)."""
    i, a, j, b = pair
    need = _selects(i, a)
    for k, alts in _selects(j, b).items():
        need[k] = need.get(k, alts) & alts
    if not all(need.values()):
        return None
    return forcing(need)


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
    """Pairs the strategy cannot draw: ruled out by `drawable.SHOWS_ONLY` (not drawn), or taken by no draw with both
    alternatives forced."""
    sampled_not_drawable: list[Pair] = field(default_factory=list)
    """Of those, the ones only the draws showed (no rule of `drawable` says why): a rule to add, or a pair so rare
    that `DRAWS` draws missed it."""
    left: list[Pair] = field(default_factory=list)
    """Pairs no example took when the budget was spent (drawable or not: not tried; a pair run once in a run that
    ended early, whose retry the budget cut, is in ``ended_early``)."""
    ended_early: list[Pair] = field(default_factory=list)
    """Pairs whose every example (after the last round) ended on an exception: drawn, not run to the end."""
    draw_seconds: float = 0.0
    """Wall seconds spent in the forced draws, both rounds (the first round's beside the generated lanes, at a
    lower priority: mostly not waited for)."""
    waited_seconds: float = 0.0
    """Wall seconds a worker waited for the completion's next examples: its cost to the run."""
    draw_helpers: str | None = None
    """Why the helper processes drawing ahead were given up (`draw_pool.DrawPool`; the draws were then made in the
    exploration's process, the same draws, only later), or None."""

    def to_dict(self) -> dict[str, object]:
        return {"missing_after_generation": self.missing, "examples": len(self.examples),
                "not_drawable": [pair_name(p) for p in self.not_drawable],
                "not_drawable_by_sampling": [pair_name(p) for p in self.sampled_not_drawable],
                "left": [pair_name(p) for p in self.left], "ended_early": [pair_name(p) for p in self.ended_early],
                "draw_seconds": round(self.draw_seconds, 1), "waited_seconds": round(self.waited_seconds, 1),
                **({"draw_helpers_failed": self.draw_helpers} if self.draw_helpers else {})}


Drawer = Callable[[Pair, Sequence[Pair]], "tuple[Scenario, ...] | None"]
"""``(pair, next) -> draws(pair, seed)``: the forced draws of ``pair``; ``next`` are the pairs `complete` is likely
to ask for after it (a pool may draw them meanwhile)."""


def complete(ran: Iterable[Scenario], budget: int, seed: int | None, ended: Iterable[Scenario] = (),
             skip: Iterable[Pair] = (), drawer: Drawer | None = None) -> Completion:
    """The completion of ``ran`` (module docstring): at most ``budget`` new scenarios.  ``ended``: those of
    ``ran`` whose run ended early (their pairs do not count as taken); ``skip``: pairs not to draw again (found
    not drawable before); ``drawer``: where the forced draws are made (default: here, one pair at a time; the
    result is the same wherever they are drawn)."""
    out = Completion()
    for _ in completing(out, ran, budget, seed, ended, skip, drawer):
        pass
    return out


def completing(out: Completion, ran: Iterable[Scenario], budget: int, seed: int | None,
               ended: Iterable[Scenario] = (), skip: Iterable[Pair] = (),
               drawer: Drawer | None = None) -> Generator[Scenario, None, None]:
    """`complete`, one example at a time: each is yielded as soon as it is chosen (its lane can run while the
    next ones are drawn), and ``out`` holds what is known so far (``left`` once the generator is exhausted)."""
    ran = list(ran)
    seen = set(ran)
    covered = _taken_through(ran, ended)
    passed = set(skip)
    missing = [p for p in all_pairs() if p not in covered and p not in passed]
    out.missing = len(missing)
    todo = list(missing)
    draw = drawer or (lambda pair, _next: draws(pair, seed))
    while todo and len(out.examples) < budget:
        pair = todo[0]
        if undrawable(pair):  # decided from the strategy's structure: no draw could take it
            out.not_drawable.append(pair)
            todo.pop(0)
            continue
        best = best_of(pair, draw(pair, [p for p in todo[1:] if not undrawable(p)]), seen, set(todo))
        if best is None:
            out.not_drawable.append(pair)
            out.sampled_not_drawable.append(pair)
            todo.pop(0)
            continue
        out.examples.append(best)
        seen.add(best)
        took = pairs_of(best)
        todo = [p for p in todo if p not in took]
        yield best
    out.left = todo


def draws(pair: Pair, seed: int | None) -> tuple[Scenario, ...] | None:
    """The `DRAWS` scenarios drawn with ``pair`` forced, in order (None: its two alternatives need different
    alternatives of one point).  A function of (pair, seed) alone, so any process draws the same, and kept on
    disk once drawn (`draw_cache`)."""
    weights = forced(pair)
    if weights is None:
        return None
    return kept_draws(pair, weights, _seed(seed, pair))


def kept_draws(key: tuple[int, ...], weights: Weights | None, seed: int) -> tuple[Scenario, ...]:
    """`DRAWS` scenarios of the default strategy at ``weights`` (None: its own rates) from ``seed``, kept on disk
    under ``key`` once drawn (`draw_cache`)."""
    from zerostate.explorer import draw_cache
    from zerostate.explorer.strategies import scenarios
    kept = draw_cache.load(key, seed, DRAWS)
    if kept is not None:
        return kept
    drawn = tuple(generated(scenarios(weights=weights), DRAWS, seed))
    draw_cache.store(key, seed, DRAWS, drawn)
    return drawn


def best_of(pair: Pair, drawn: Iterable[Scenario] | None, seen: set[Scenario] | frozenset[Scenario] = frozenset(),
            left: set[Pair] | frozenset[Pair] = frozenset()) -> Scenario | None:
    """Of ``drawn``, the first scenario not in ``seen`` that takes ``pair`` and the most of
    ``left``; None: none took it."""
    best, gain = None, -1
    for sc in drawn or ():
        got = pairs_of(sc)
        if pair not in got or sc in seen:
            continue
        if len(got & left) > gain:
            best, gain = sc, len(got & left)
    return best


def draw_for(pair: Pair, seed: int | None, seen: set[Scenario] | frozenset[Scenario] = frozenset(),
             left: set[Pair] | frozenset[Pair] = frozenset()) -> Scenario | None:
    """Of `DRAWS` scenarios drawn with ``pair`` forced, one not in ``seen`` that takes it and
    the most of ``left`` (the first such); None: none took it."""
    return best_of(pair, draws(pair, seed), seen, left)


ROUNDS = 2
"""Completion rounds: the first completes the generated scenarios' pairs (no outcome read), the second redraws
what runs that ended early, generated or first-round, left not taken (module docstring)."""

ENDS_RUN = frozenset({"exception", "saved-tensor-intact", "hang", "crash", "oracle-error", "internal"})
"""Checks whose finding means the run stopped there (the rest of the scenario did not run)."""


def ran_through(checks: Iterable[str]) -> bool:
    """Whether a run whose findings have these checks reached its end."""
    return not any(c in ENDS_RUN or c.startswith("harness") for c in checks)


def ended_only(ran: Iterable[Scenario], ended: Iterable[Scenario]) -> list[Pair]:
    """The pairs some scenario of ``ran`` takes and only those of ``ended`` (runs that ended early) do."""
    ran = list(ran)
    return sorted(set().union(*map(pairs_of, ran)) - _taken_through(ran, ended))


def _taken_through(ran: list[Scenario], ended: Iterable[Scenario]) -> set[Pair]:
    """The pairs the scenarios of ``ran`` not in ``ended`` (runs that reached their end) take."""
    early = set(ended)
    return set().union(*(pairs_of(sc) for sc in ran if sc not in early))


def budget_for(examples: int) -> int:
    return examples // BUDGET_SHARE


__all__ = ["BUDGET_SHARE", "Completion", "DRAWS", "LABELS", "Pair", "all_pairs", "alternatives", "budget_for",
           "DERIVED", "Derived", "ENDS_RUN", "ROUNDS", "WRAPPER", "Z3_REDUCE",
           "Drawer", "ended_only", "ran_through", "best_of", "complete", "completing", "draw_for", "draws",
           "forced", "kept_draws", "pair_name", "pairs_of", "sizes"]
