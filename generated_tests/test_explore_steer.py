"""Coverage-guided steering (`explorer/choices.py`, `steering_schedule.py`, `signal.py`, `rounds.py`;
``explore --steer``).

The scheduler is a pure function: determinism, the floor and the cap, and the fold's sequence order are tested on
hand-made rounds.  The steered exploration is tested on the model target (cheap, deterministic): the same
sequence, schedules and findings with one job and two, a first round that is the unsteered sequence's start,
and findings shrunk over their own round's strategy."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from zerostate.explorer import choices
from zerostate.explorer.choices import DEFAULT, POINTS, SCALE, Weights
from zerostate.explorer.generate import Lanes, generated
from zerostate.explorer.steering_schedule import CAP, Folded, cap, floor, recut, round_seed, schedule
from zerostate.explorer.signal import fold, monitor_states, shape
from zerostate.explorer.strategies import PRECISIONS, scenarios
from zerostate.model.scenario import Precision

from test_cli_util import zs

NONE = tuple(frozenset() for _ in POINTS)


def _took(**alts: int) -> tuple[frozenset[int], ...]:
    return tuple(frozenset((alts[p.name],)) if p.name in alts else frozenset() for p in POINTS)


def test_a_round_with_nothing_new_keeps_the_weights() -> None:
    assert schedule(DEFAULT, []) == DEFAULT
    assert schedule(DEFAULT, [Folded(_took(precision=2), 0)] * 5) == DEFAULT


def test_the_scheduler_is_a_function_of_its_inputs_and_keeps_each_total() -> None:
    rnd = [Folded(_took(precision=i % 3, stage=i % 2), (i * 7) % 11) for i in range(40)]
    a, b = schedule(DEFAULT, rnd), schedule(DEFAULT, list(rnd))
    assert a == b and a != DEFAULT
    for p, w in zip(POINTS, a.table, strict=True):
        assert sum(w) == sum(p.default) * SCALE
        assert all(floor(d) <= x <= cap(d) for x, d in zip(w, p.default, strict=True))


def test_an_alternative_whose_examples_reach_new_units_rises_and_the_others_stay_above_the_floor() -> None:
    fp16 = [Folded(_took(precision=2), 50) for _ in range(10)]
    fp32 = [Folded(_took(precision=0), 0) for _ in range(10)]
    w, seen = DEFAULT, [DEFAULT.of("precision")]
    for _ in range(8):  # compounding rounds: fp16 climbs, fp32 sinks to its floor, never below
        w = schedule(w, fp16 + fp32)
        seen.append(w.of("precision"))
    assert all(b[2] >= a[2] and b[0] <= a[0] for a, b in itertools.pairwise(seen))
    fp32_w, bf16_w, fp16_w = w.of("precision")
    assert fp16_w >= 2 * SCALE  # from one draw in four to one in two at least
    assert floor(2) == SCALE <= fp32_w <= SCALE + 2  # about half its default weight 2 * SCALE: still drawn
    assert fp32_w + bf16_w + fp16_w == 4 * SCALE
    assert w.of("stage") == DEFAULT.of("stage")  # no example showed a stage: untouched


def test_the_cap_binds_and_its_excess_goes_to_the_others() -> None:
    assert recut([0, 10 ** 9], (7, 1)) == (8 * SCALE - cap(1), cap(1)) == (4 * SCALE, CAP * SCALE)


def test_recut_shares_by_score_with_index_order_ties() -> None:
    assert recut([1, 1, 1], (1, 1, 1)) == (SCALE, SCALE, SCALE)
    assert recut([0, 0, 0], (2, 1, 1)) == (2 * SCALE, SCALE, SCALE)
    tie = recut([1, 1, 1], (1, 1, 0 + 1))
    assert tie == (SCALE, SCALE, SCALE)
    odd = recut([1, 1, 1, 0], (1, 1, 1, 1))  # 32 left over for three: 11, 11, 10 -- the lower indices first
    assert odd == (SCALE // 2 + 11, SCALE // 2 + 11, SCALE // 2 + 10, SCALE // 2)


def test_the_fold_counts_each_unit_for_the_first_example_in_sequence_order() -> None:
    a, b = frozenset({"x", "y"}), frozenset({"y", "z"})
    union: set[object] = {"w"}
    first = fold([(_took(stage=0), a), (_took(stage=1), b)], union)  # type: ignore[list-item]
    assert [f.new for f in first] == [2, 1] and union == {"w", "x", "y", "z"}
    swapped = fold([(_took(stage=1), b), (_took(stage=0), a)], {"w"})  # type: ignore[list-item]
    assert [f.new for f in swapped] == [2, 1]
    assert schedule(DEFAULT, first).of("stage") != schedule(DEFAULT, swapped).of("stage")


def test_round_seeds() -> None:
    assert round_seed(0, 0) == 0 and round_seed(7, 0) == 7
    assert round_seed(0, 1) == round_seed(0, 1) != round_seed(0, 2) != round_seed(1, 2)


def test_default_weights_draw_the_unsteered_sequence_and_moved_ones_move_the_draws() -> None:
    plain = list(generated(scenarios(), 60, 0))
    assert list(generated(scenarios(weights=DEFAULT), 60, 0)) == plain
    table = list(DEFAULT.table)
    i = [p.name for p in POINTS].index("precision")
    table[i] = (SCALE // 2, SCALE // 2, 3 * SCALE)  # fp16 at three in four instead of one in four (Hypothesis
    # generates runs of near copies, so a sequence's rates are only near the nominal ones: a stronger move)
    moved = [sc.precision for sc in generated(scenarios(weights=Weights(tuple(table))), 200, 0)]
    before = [sc.precision for sc in generated(scenarios(), 200, 0)]
    assert Counter(moved)[Precision.FP16] > Counter(before)[Precision.FP16]


def test_a_completion_only_alternative_is_never_generated() -> None:
    assert {"extra:reduce_scatter", "reduce_bucket", "scheduler", "decay_groups", "unused_in_step",
            "gathered", "gathered_inside", "resume", "zero_grad"} == \
        choices.COMPLETION_ONLY
    only = {name: {a for a, d in enumerate(choices.BY_NAME[name].default) if d == 0}
            for name in choices.COMPLETION_ONLY}
    for sc in generated(scenarios(), 200, 0):
        took = dict(zip([p.name for p in POINTS], choices.taken(sc), strict=True))
        assert all(not (only[name] & took[name]) for name in choices.COMPLETION_ONLY)


def test_each_point_default_is_the_strategy_rate() -> None:
    expand = {p.name: p.default for p in POINTS}
    assert expand["precision"] == tuple(PRECISIONS.count(x) for x in (Precision.FP32, Precision.BF16,
                                                                       Precision.FP16))
    assert choices.pick(DEFAULT, "precision", "own", ("a", "b", "c")) == "own"
    assert choices.pick(None, "precision", "own", ("a", "b", "c")) == "own"
    assert choices.pick(DEFAULT, "precision", "own", ("only",)) == "own"  # a caller's own alternatives


def test_taken_reads_what_the_strategy_drew() -> None:
    for sc in generated(scenarios(), 80, 0):
        took = dict(zip([p.name for p in POINTS], choices.taken(sc), strict=True))
        assert took["stage"] == (frozenset() if sc.stage == 0 else frozenset(((3, 1, 2).index(sc.stage),)))
        assert took["precision"] == frozenset(((Precision.FP32, Precision.BF16, Precision.FP16).index(sc.precision),))
        several = sc.world_size > 1
        assert took["world"] <= {0, 1, 2} and several == bool(took["world"] & {1, 2})
        assert (sc.world_size == 4) <= (took["world"] == {2})


def test_monitor_state_shapes_drop_names() -> None:
    from zerostate.targets.interface import get_target
    assert shape(frozenset({"blocks.0.lin.weight"})) == shape(frozenset({"head.weight"})) == ("frozenset", 1)
    assert shape("RECORD") == "RECORD" and shape("blocks.0") == "name"
    t = get_target("model")
    sc = next(iter(generated(scenarios(), 1, 0)))
    got = monitor_states(t.run(sc).trace)
    assert got and all(isinstance(u, tuple) and len(u) == 3 for u in got)
    assert monitor_states(t.run(sc).trace) == got


def _steered(jobs: int, examples: int = 60, design: str = "ds-0.18.4"):  # type: ignore[no-untyped-def]
    from zerostate.explorer.exploration import Exploration
    from zerostate.targets.interface import get_target
    exp = Exploration(get_target("model", design=design), examples=examples, seed=0, steer="coverage",
                      round_size=20, jobs=jobs, spawn=lambda: get_target("model", design=design), confirm=False)
    with contextlib.closing(exp.events()) as events:
        for _ in events:
            pass
    return exp


def test_steered_model_exploration_is_the_same_with_one_job_and_two() -> None:
    one, two = _steered(1), _steered(2)
    r1, r2 = one.result(), two.result()
    assert one.positions == two.positions and len(one.positions) == 60
    assert r1.schedules == r2.schedules and len(r1.schedules) == 3
    assert r1.schedules[1] != r1.schedules[0] == DEFAULT.to_dict()  # the signal moved the rates
    assert r1.new_units == r2.new_units and r1.new_units[0] > 0
    # hand-over order follows which lane ends first; each key's finding and first position do not
    assert {f.key: f.scenario for f in r1.findings} == {f.key: f.scenario for f in r2.findings}
    assert r1.generated_at == r2.generated_at
    assert r1.findings and r1.rounds == r2.rounds and set(r1.rounds) == {f.key for f in r1.findings}


def test_round_zero_is_the_unsteered_sequence_start() -> None:
    """At the same budget (Hypothesis's generation depends on ``max_examples``): round 0 is the first 20 distinct
    scenarios of the unsteered sequence."""
    exp = _steered(1, examples=40)
    plain = Lanes(generated(scenarios(), 40, 0), 100)
    first = [sc for lane in plain for sc in lane][:20]
    assert sorted(exp.positions, key=exp.positions.__getitem__)[:20] == first


def test_cli_steer_records_every_round_and_refuses_a_matrix(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    r = zs("explore", "--target", "model", "--design", "ds-0.18.4", "--examples", "30", "--steer", "coverage",
           "--out", str(out))
    assert r.returncode == 1, r.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["run"]["steer"] == "coverage"
    assert rep["steering"]["schedules"][0] == DEFAULT.to_dict() and len(rep["steering"]["schedules"]) == 2
    assert set(rep["steering"]["finding_rounds"]) == {f["key"] for f in rep["findings"]}
    bad = zs("explore", "--deepspeed", "0.19.2,0.19.8", "--steer", "coverage", "--out", str(tmp_path / "m"))
    assert bad.returncode == 2 and "--steer coverage" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("name", [p.name for p in POINTS])
def test_every_point_has_a_default_and_a_reading(name: str) -> None:
    p = choices.BY_NAME[name]
    assert len(p.default) >= 2 and p.default[0] > 0
    assert all(d > 0 for d in p.default) or name in choices.COMPLETION_ONLY
    sc = next(iter(generated(scenarios(), 1, 0)))
    assert all(0 <= a < len(p.default) for a in p.taken(sc))
