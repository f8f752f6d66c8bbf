"""The explorer's parts on their own, on the model target (a pure function, so cheap and deterministic): the lanes
on the workers (`workers`), a shrink search for one key (`search`) and the steered rounds (`rounds`).  Whole
explorations are tested through ``explore`` (test_cli_explore.py, test_pairs.py, test_explore_steer.py)."""

from __future__ import annotations

import threading
from itertools import pairwise

import pytest

from zerostate.explorer import workers
from zerostate.explorer.choices import DEFAULT
from zerostate.explorer.generate import generated
from zerostate.explorer.rounds import Rounds
from zerostate.explorer.search import ShrinkSearch, no_shrink_deadline
from zerostate.explorer.strategies import scenarios
from zerostate.model import get_design
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Target, get_target

CORE = scenarios(setup=False)
A, B, C = (Scenario.from_dict({"blocks": [{}] * n, "stage": 3}) for n in (1, 2, 3))


class _Worker(Target):
    """A worker that records what it ran and how often it started afresh."""

    name, version, can_refresh = "fake", None, True

    def __init__(self, fail_on: Scenario | None = None):
        self.design = get_design("zerostate")
        self.ran: list[Scenario | None] = []
        self.fail_on = fail_on
        self.closed = False

    def run(self, scenario: Scenario) -> Outcome:
        if scenario == self.fail_on:
            raise RuntimeError("the target broke")
        self.examples += 1
        self.ran.append(scenario)
        return Outcome(scenario)

    def fresh(self) -> None:
        self.ran.append(None)

    def close(self) -> None:
        self.closed = True


# ------------------------------------------------------------------ workers
def test_one_worker_runs_each_lane_in_order_from_a_fresh_start():
    w = _Worker()
    steps = list(workers.run_lanes([w], iter([[A, B], [C]]), threading.Event(), [False]))
    assert [s.scenario for s in steps] == [None, A, B, None, C]  # a step per fresh start, then its runs
    assert w.ran == [A, B, None, C], "the first lane in the worker as it is, the next from a fresh start"
    assert workers.has_run(w) and not workers.has_run(_Worker())


def test_several_workers_share_the_lanes_and_run_each_scenario_once():
    ws = [_Worker(), _Worker()]
    lanes = [[Scenario.from_dict({"blocks": [{}], "stage": 3, "seed": i})] for i in range(6)]
    steps = list(workers.run_lanes(ws, iter(lanes), threading.Event(), [False, False]))
    ran = [s.scenario for s in steps if s.scenario is not None]
    assert sorted(ran, key=lambda sc: sc.seed) == [lane[0] for lane in lanes]
    for w in ws:  # lanes of one: a fresh start between every two of a worker's runs, none before its first
        assert not w.ran or (w.ran[0] is not None and all((a is None) != (b is None) for a, b in pairwise(w.ran)))
    assert sum(w.examples for w in ws) == 6


def test_a_target_that_breaks_ends_its_lane_with_the_error():
    w = _Worker(fail_on=B)
    steps = list(workers.run_lanes([w], iter([[A, B, C]]), threading.Event(), [False]))
    assert [s.scenario for s in steps] == [None, A, B] and isinstance(steps[-1].error, RuntimeError)


def test_workers_are_spawned_all_or_none():
    made: list[_Worker] = []

    def spawn() -> _Worker:
        if len(made) == 2:
            raise RuntimeError("no third worker")
        made.append(_Worker())
        return made[-1]
    with pytest.raises(RuntimeError, match="no third worker"):
        workers.spawn_workers(3, spawn)
    assert len(made) == 2 and all(w.closed for w in made)
    assert not workers.refresh(get_target("model", design="zerostate")), "a pure function needs no fresh start"


# ------------------------------------------------------------------ search
def test_a_shrink_search_replays_the_sequence_from_memory_and_ends_on_a_scenario_with_its_key():
    t = get_target("model", design="ds-0.18.4")
    memo: dict[Scenario, Outcome] = {}
    for sc in generated(CORE, 40, None):
        memo.setdefault(sc, t.run(sc))
    key = next(f.key for out in memo.values() for f in out.findings)
    known = dict(memo)
    search = ShrinkSearch(CORE, 40, None, key, memo.get)
    asked = []
    try:
        for sc in search.requests():
            asked.append(sc)
            memo[sc] = t.run(sc)
            search.answer(memo[sc])
    finally:
        search.close()
    assert search.found is not None and any(f.key == key for f in memo[search.found].findings)
    assert not set(asked) & set(known), "the generated sequence's runs come from memory, not the target"


def test_shrinking_is_bounded_by_runs_not_by_the_clock():
    from hypothesis.internal.conjecture import engine
    before = engine.MAX_SHRINKING_SECONDS
    with no_shrink_deadline():
        assert engine.MAX_SHRINKING_SECONDS > 10 ** 6
    assert before == engine.MAX_SHRINKING_SECONDS


# ------------------------------------------------------------------ rounds
def test_steered_rounds_draw_distinct_scenarios_a_round_at_a_time():
    """Each round is drawn only once every scenario of the one before has its outcome (`note`); a lane never
    spans two rounds; round 0 is the unsteered sequence's start."""
    rounds = Rounds(examples=24, seed=None, size=8, lane=3, stop=threading.Event(), reweigh=False)
    lanes = []
    for lane in rounds:
        lanes.append(lane)
        for sc in lane:
            rounds.note(sc, frozenset())
    drawn = [sc for lane in lanes for sc in lane]
    assert len(drawn) == len(set(drawn)) == 24 and [len(lane) for lane in lanes] == [3, 3, 2] * 3
    assert all(len({rounds.round_at[sc] for sc in lane}) == 1 for lane in lanes)
    assert sorted(rounds.round_at.values()) == [0] * 8 + [1] * 8 + [2] * 8
    assert rounds.weights == [DEFAULT] * 3 and rounds.new_units == [0, 0]
    unsteered = list(dict.fromkeys(generated(rounds.strategy(0), 24, None)))
    assert drawn[:8] == unsteered[:8]


def test_a_stop_ends_the_rounds_while_a_round_waits_for_its_outcomes():
    stop = threading.Event()
    rounds = Rounds(examples=24, seed=None, size=8, lane=8, stop=stop)
    it = iter(rounds)
    assert len(next(it)) == 8
    stop.set()  # round 0's outcomes never landed
    assert next(it, None) is None
