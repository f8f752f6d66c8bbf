"""The pairwise completion (`explorer.pairs`): which setup pairs the generated examples left out, drawn and run.

Drawing only (no target runs), except the last test, which explores the model target (a wrapper of it whose
ZeRO-1 runs end on an exception)."""

from __future__ import annotations

import itertools
import re

import pytest

from zerostate.explorer.choices import PAIRED as POINTS
from zerostate.explorer.generate import generated
from zerostate.explorer.pairs import (DERIVED, WRAPPER, Z3_REDUCE, Completion, all_pairs, budget_for, complete,
                                      draw_for, ended_only, forced, pair_name, pairs_of, ran_through, sizes)
from zerostate.explorer.strategies import scenarios
from zerostate.findings.finding import Finding
from zerostate.harness.net.config import ds_config
from zerostate.model.scenario import Offload, Precision, Scenario
from zerostate.targets.interface import Outcome, Target, get_target
from zerostate.explorer.exploration import COMPLETION_LANE


@pytest.fixture(autouse=True)
def draws_drawn_here(monkeypatch):
    """Every draw in this module is made, none read from `draw_cache`: the helpers' draws are compared with
    this process's, and how long drawing waits is measured."""
    from zerostate.explorer import draw_cache
    monkeypatch.setenv(draw_cache.ENV, "0")

_K = {p.name: k for k, p in enumerate(POINTS)}


_K.update({d.name: len(POINTS) + k for k, d in enumerate(DERIVED)})


def _pair(p: str, a: int, q: str, b: int) -> tuple[int, int, int, int]:
    i, j = _K[p], _K[q]
    return (i, a, j, b) if i < j else (j, b, i, a)


def _distinct(n: int) -> list:
    return list(dict.fromkeys(generated(scenarios(), n, None)))


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
    assert a.examples == b.examples
    assert 0 < len(a.examples) <= 3
    assert not set(a.examples) & set(ran)
    covered = set().union(*(pairs_of(s) for s in ran))
    missing = [p for p in all_pairs() if p not in covered]
    assert a.missing == len(missing)
    taken_now = set().union(*(pairs_of(s) for s in a.examples))
    assert set(a.left) == set(missing) - taken_now - set(a.not_drawable)
    assert all(p in missing for p in a.not_drawable) and not set(a.not_drawable) & taken_now


def test_at_the_default_budget_every_drawable_pair_of_the_default_sequence_runs() -> None:
    """The default 200 leave pairs out (no ZeRO-1 scenario in bf16 among them); their completion, within one
    example per six, runs every pair the strategy can draw -- none is left for want of budget -- and proves no
    pair not drawable by sampling."""
    ran = _distinct(200)
    assert not any(s.stage == 1 and s.precision is Precision.BF16 for s in ran)
    done: Completion = complete(ran, budget_for(200), None)
    assert done.left == [] and len(done.examples) <= budget_for(200)
    # drawability decided (`explorer.drawable`): every pair it cannot draw is ruled out by the table, undrawn; none
    # is left for the 64 draws that used to prove it
    from zerostate.explorer.drawable import undrawable
    assert done.sampled_not_drawable == [], [pair_name(p) for p in done.sampled_not_drawable]
    assert done.not_drawable and all(undrawable(p) for p in done.not_drawable)
    assert any(s.stage == 1 and s.precision is Precision.BF16 and s.fp32_grad_accum for s in done.examples)


def test_the_optimizer_wrapper_is_a_point_and_its_pairs_are_drawn_by_what_selects_it() -> None:
    """BF16_Optimizer (ZeRO-1 + bf16 + fp32 accumulation, no offload) paired with clipping 0.05 comes out of the
    forced draw; paired with ZeRO-3, or with optimizer offload, it cannot (forced refuses at once)."""
    bf16_clip = _pair("wrapper", 1, "clipping", 2)
    sc = draw_for(bf16_clip, None)
    assert sc is not None and WRAPPER.of(sc) == 1 and sc.gradient_clipping == 0.05
    assert (sc.stage, sc.precision, sc.fp32_grad_accum, sc.offload) == (1, Precision.BF16, True, Offload.NONE)
    assert forced(_pair("stage", 0, "wrapper", 1)) is None and forced(_pair("offload", 1, "wrapper", 1)) is None
    assert pair_name(bf16_clip) == "clipping=0.05 x wrapper=BF16_Optimizer"
    assert [WRAPPER.of(Scenario.from_dict(d)) for d in (
        {"stage": 2}, {"stage": 1, "precision": "bf16", "fp32_grad_accum": True},
        {"stage": 1, "precision": "bf16", "fp32_grad_accum": True, "offload": "optimizer"},
        {"stage": 0, "precision": "fp16"}, {"stage": 0})] == [0, 1, 0, 2, 3]


def test_zero3s_reduce_route_is_a_point_paired_with_a_bucket_of_exactly_one_weight() -> None:
    """ZeRO-3 reduces its bucket's contiguous buffer only with contiguous gradients on and reduce_scatter off (a
    derived point); the bucket of exactly one Linear weight (``width**2``) is never generated, so the pair comes
    only from the completion's forced draw, and the drawn scenario shows both."""
    route = _pair("z3_reduce", 2, "reduce_bucket", 2)
    sc = draw_for(route, None)
    assert sc is not None and pair_name(route) == "reduce_bucket=one weight x z3_reduce=contiguous buffer"
    assert (sc.stage, sc.contiguous_gradients, sc.reduce_scatter, sc.reduce_bucket_size) == (3, True, False,
                                                                                         sc.width * sc.width)
    assert [Z3_REDUCE.of(Scenario.from_dict(d)) for d in (
        {"stage": 2, "reduce_scatter": False}, {"stage": 3}, {"stage": 3, "reduce_scatter": False},
        {"stage": 3, "reduce_scatter": False, "contiguous_gradients": False})] == [0, 1, 2, 1]
    assert not any(g.reduce_bucket_size == g.width * g.width for g in generated(scenarios(), 200, None))


def test_reduce_scatter_off_is_drawn_by_the_completion_alone() -> None:
    """The generated sequence never turns ZeRO's reduce_scatter off (the option takes none of its bytes); a
    forced pair does, and the engine config says so."""
    assert all(s.reduce_scatter for s in _distinct(200))
    sc = draw_for(_pair("stage", 0, "extra:reduce_scatter", 1), None)
    assert sc is not None and sc.stage == 3 and not sc.reduce_scatter
    assert ds_config(sc)["zero_optimization"]["reduce_scatter"] is False
    assert "reduce_scatter" not in ds_config(sc.with_(reduce_scatter=True))["zero_optimization"]
    assert Scenario.from_json(sc.to_json()) == sc and "reduce_scatter=False" in sc.beyond_model()


def test_a_pair_taken_only_by_runs_that_ended_early_is_drawn_again() -> None:
    ran = _distinct(40)
    ended = [s for s in ran if s.stage == 1]
    only = set(ended_only(ran, ended))
    assert only and only == set().union(*map(pairs_of, ran)) - set().union(*(pairs_of(s) for s in ran if s.stage != 1))
    plain, again = complete(ran, 0, None), complete(ran, 0, None, ended)
    assert again.missing == plain.missing + len(only)
    assert ran_through(["oracle", "epilogue-once"]) and not ran_through(["oracle", "exception"])
    assert not ran_through(["harness-error"]) and not ran_through(["hang"])


class _EndsAtZero1(Target):
    """The model target, but every ZeRO-1 run ends on an exception (as a known crash would end it)."""

    name, version = "ends-at-zero1", None

    def __init__(self) -> None:
        self.inner = get_target("model", design="zerostate")
        self.design = self.inner.design

    def run(self, sc: Scenario) -> Outcome:
        out = self.inner.run(sc)
        if sc.stage == 1:
            out.findings.append(Finding("exception", "RuntimeError: ended here", sc, target=self.name))
        return out


def test_explore_redraws_in_a_second_round_what_the_first_rounds_runs_ended_on(monkeypatch) -> None:
    """Over three pairs (the rest monkeypatched away), a ZeRO-1 pair is drawn in both rounds -- each of its
    runs ends early -- and the report says it ran only in runs that ended; the ZeRO-2 pair once."""
    from zerostate.explorer import pairs
    from zerostate.explorer.exploration import explore
    three = [_pair("stage", 1, "precision", 1), _pair("stage", 1, "precision", 2), _pair("stage", 2, "precision", 2)]
    monkeypatch.setattr(pairs, "all_pairs", lambda: three)
    res = explore(_EndsAtZero1(), examples=12, seed=None)
    done = res.pairs
    assert done is not None
    names = [pair_name(p) for p in three]
    zero1 = [s for s in res_examples(res) if s.stage == 1]
    assert set(done["ended_early"]) >= {n for n in names[:2] if n not in done["not_drawable"]}
    assert done["examples"] == len(res_examples(res)) and len(zero1) >= 2
    assert names[2] not in done["ended_early"]


def res_examples(res) -> list[Scenario]:
    """The completion's scenarios, by position after the generated ones."""
    return [Scenario.from_dict(g["scenario"]) for g in res.generated if g["position"] > 12]


def _same(a: Completion, b: Completion) -> None:
    assert a.examples == b.examples
    assert (a.not_drawable, a.left, a.missing) == (b.not_drawable, b.left, b.missing)


def test_helpers_drawing_ahead_make_the_completion_drawn_here() -> None:
    """The forced draws made in helper processes, pairs ahead (`draw_pool`), give the completion drawn in this
    process: the same examples in the same order, the same pairs found not drawable."""
    from zerostate.explorer.draw_pool import DrawPool
    ran = _distinct(40)
    here = complete(ran, 4, None)
    with DrawPool(None, 2) as pool:
        helped = complete(ran, 4, None, drawer=pool)
        assert pool.failure is None
    _same(here, helped)
    assert here.not_drawable, "the case that costs: pairs drawn 64 times in vain"


def test_a_helper_that_fails_is_said_and_the_draws_are_made_here(monkeypatch) -> None:
    """A helper that dies (here: exits at once) gives up the helpers, says why, and the completion is the one
    drawn here -- never a completion cut short or changed."""
    import sys

    from zerostate.explorer import draw_pool
    monkeypatch.setattr(draw_pool, "HELPER", (sys.executable, "-c", "raise SystemExit(3)"))
    ran = _distinct(40)
    with draw_pool.DrawPool(None, 2) as pool:
        helped = complete(ran, 2, None, drawer=pool)
        assert pool.failure is not None and re.search(r"helper exit status (-?\d+, )*3\b", pool.failure), pool.failure
    _same(complete(ran, 2, None), helped)
    helped.draw_helpers = pool.failure
    assert helped.to_dict()["draw_helpers_failed"] == pool.failure


def test_the_summary_line_says_the_draws_were_made_here_when_the_helpers_failed() -> None:
    from zerostate.cli.cmd_explore import _pairs_line
    done = Completion(examples=[], missing=3)
    assert "draw helpers" not in _pairs_line(done.to_dict())
    done.draw_helpers = "RuntimeError: a draw helper ended (helper exit status 3, 3)"
    line = _pairs_line(done.to_dict())
    assert line.endswith("its draws were made in this process, the draw helpers failed: RuntimeError: a draw helper "
                         "ended (helper exit status 3, 3)"), line


def test_the_first_round_reads_no_outcome() -> None:
    """The first round completes the generated scenarios' pairs whatever their runs did: an exploration whose
    ZeRO-1 runs all end early runs the same first-round examples, at the same positions, as one whose runs do
    not (a completion that read them would differ)."""
    from zerostate.explorer.exploration import explore
    ran = _distinct(12)
    first = complete(ran, budget_for(12), None).examples
    hid = complete(ran, budget_for(12), None, [s for s in ran if s.stage == 1]).examples
    assert first and hid != first, "reading outcomes would differ"
    plain = explore(get_target("model", design="zerostate"), examples=12, seed=None)
    ended = explore(_EndsAtZero1(), examples=12, seed=None)
    for res in (plain, ended):
        assert res_examples(res)[:len(first)] == first


def test_the_first_round_is_drawn_before_its_lanes_are_asked_for() -> None:
    """With a drawer (helper processes), the first round is drawn in a thread from the start: a worker that runs
    out of generated lanes finds its examples chosen, not drawn then.  They are the examples drawn in one piece."""
    import threading

    from zerostate.explorer.first_round import FirstRound
    from zerostate.explorer.pairs import draws
    ran = _distinct(40)
    drawn = threading.Event()

    def drawer(pair, _next):
        drawn.set()
        return draws(pair, None)
    done = Completion()
    with FirstRound(done, ran, 4, None, drawer) as first:
        assert drawn.wait(60), "nothing was drawn before the round's examples were asked for"
        got = list(first.examples(threading.Event()))
    _same(complete(ran, 4, None), done)
    assert got == done.examples and done.draw_seconds > 0


def test_two_jobs_drawing_in_helpers_run_the_completion_of_one_job(monkeypatch) -> None:
    """Two workers, the first round drawn in helper processes while the generated lanes run, give the examples,
    positions and outcomes of one worker drawing after them (the round is handed out lane by lane as drawn)."""
    from zerostate.explorer import exploration
    monkeypatch.setattr(exploration.os, "cpu_count", lambda: 2)  # helpers, whatever this machine has

    def run(jobs: int):
        return exploration.explore(get_target("model", design="ds-0.18.5"), examples=40, seed=None, jobs=jobs,
                                   spawn=lambda: get_target("model", design="ds-0.18.5"), lane=25, shrink=False)
    one, two = run(1), run(2)
    assert [(g["position"], g["scenario"], g["findings"]) for g in two.generated] == \
        [(g["position"], g["scenario"], g["findings"]) for g in one.generated]
    assert one.pairs and two.pairs and one.pairs["examples"] > COMPLETION_LANE
    assert one.pairs["waited_seconds"] > 0, "one job draws when its lane is asked for: it waits"
    timing = ("draw_seconds", "waited_seconds")
    assert {k: v for k, v in two.pairs.items() if k not in timing} == \
        {k: v for k, v in one.pairs.items() if k not in timing}


# ---------------------------------------------------------------- drawability decided (`explorer.drawable`)
def test_no_draw_takes_a_pair_the_drawability_table_rules_out() -> None:
    """Soundness of `drawable.SHOWS_ONLY`: the default sequence's scenarios and forced draws of pairs of every point
    (each pair's own weights, several draws each) never take a pair the table rules out -- a rule wider than the
    strategy would skip a pair the completion must run."""
    from zerostate.explorer.drawable import check_table, undrawable
    from zerostate.explorer.pairs import _seed

    check_table()
    ruled_out = {p for p in all_pairs() if undrawable(p)}
    assert ruled_out
    drawn = _distinct(200)
    drawable = [p for p in all_pairs() if p not in ruled_out and forced(p) is not None]
    for pair in drawable[:: max(1, len(drawable) // 60)]:  # 60-odd pairs over every point, 6 draws each
        drawn += list(generated(scenarios(weights=forced(pair)), 6, _seed(None, pair)))
    for sc in drawn:
        hit = pairs_of(sc) & ruled_out
        assert not hit, f"{sorted(pair_name(p) for p in hit)} drawn: {sc.describe()}"

