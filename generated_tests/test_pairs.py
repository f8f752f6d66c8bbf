"""The pairwise completion (`explorer.pairs`): which setup pairs the generated examples left out, drawn and run.

Drawing only (no target runs), except the last test, which explores the model target."""

from __future__ import annotations

import itertools

from zerostate.explorer.choices import POINTS
from zerostate.explorer.generate import generated
from zerostate.explorer.pairs import (Completion, all_pairs, budget_for, complete, draw_for, pair_name, pairs_of,
                                      sizes)
from zerostate.explorer.strategies import scenarios
from zerostate.model.scenario import Precision

_K = {p.name: k for k, p in enumerate(POINTS)}


def _pair(p: str, a: int, q: str, b: int) -> tuple[int, int, int, int]:
    i, j = _K[p], _K[q]
    return (i, a, j, b) if i < j else (j, b, i, a)


def _distinct(n: int) -> list:
    seen = {}
    for sc in generated(scenarios(), n, None):
        seen.setdefault(sc.to_json(None), sc)
    return list(seen.values())


def test_every_pair_a_scenario_takes_is_among_all_pairs() -> None:
    everything = set(all_pairs())
    assert len(everything) == sum(a * b for a, b in itertools.combinations(sizes(), 2))
    for sc in _distinct(30):
        assert pairs_of(sc) <= everything


def test_a_forced_pair_is_drawn_and_one_the_strategy_cannot_draw_is_not() -> None:
    """ZeRO-1 with fp32 gradient accumulation (drawn only in bf16) comes out of the forced draw; a z3 leaf
    module at ZeRO-1 (leaf modules are ZeRO-3's) does not."""
    zero1_accum = _pair("stage", 1, "fp32_grad_accum", 1)
    sc = draw_for(zero1_accum, None)
    assert sc is not None and sc.stage == 1 and sc.precision is Precision.BF16 and sc.fp32_grad_accum
    assert draw_for(_pair("stage", 1, "leaf", 1), None) is None
    assert pair_name(zero1_accum) == "stage=1 x fp32_grad_accum=on"


def test_the_completion_is_deterministic_new_and_takes_what_was_missing() -> None:
    ran = _distinct(40)
    a, b = complete(ran, 3, None), complete(ran, 3, None)
    assert [s.to_json(None) for s in a.examples] == [s.to_json(None) for s in b.examples]
    assert 0 < len(a.examples) <= 3
    before = {s.to_json(None) for s in ran}
    assert not any(s.to_json(None) in before for s in a.examples)
    covered = set().union(*(pairs_of(s) for s in ran))
    missing = [p for p in all_pairs() if p not in covered]
    assert a.missing == len(missing)
    taken_now = set().union(*(pairs_of(s) for s in a.examples))
    assert set(a.left) == set(missing) - taken_now - set(a.not_drawable)
    assert all(p in missing for p in a.not_drawable) and not set(a.not_drawable) & taken_now


def test_at_the_default_budget_every_drawable_pair_of_the_default_sequence_runs() -> None:
    """The default 200 leave pairs out (no ZeRO-1 scenario in bf16 among them); their completion, within one
    example per six, runs every pair the strategy can draw -- none is left for want of budget."""
    ran = _distinct(200)
    assert not any(s.stage == 1 and s.precision is Precision.BF16 for s in ran)
    done: Completion = complete(ran, budget_for(200), None)
    assert done.left == [] and len(done.examples) <= budget_for(200)
    assert any(s.stage == 1 and s.precision is Precision.BF16 and s.fp32_grad_accum for s in done.examples)
