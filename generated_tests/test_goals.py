"""Reach declared as goals (`explorer.goals`): every known DeepSpeed issue's family is run by the default exploration,
by its examples, a forced draw or the issue's own repro -- never by where the pseudo-random sequence went.

Drawing only, no target runs (the goals round's place in a DeepSpeed exploration: test_deepspeed_explorer.py)."""

from __future__ import annotations

import pytest

from zerostate.explorer.generate import generated
from zerostate.explorer.goals import FORCES, Goal, force_of, goals, reach
from zerostate.explorer.pairs import budget_for, complete
from zerostate.explorer.strategies import scenarios
from zerostate.known.issues import KNOWN_ISSUES
from zerostate.model.scenario import Block, Scenario


def test_one_goal_per_form_of_each_known_deepspeed_issue_and_survey_combination_each_reached_by_its_repro():
    """Each known DeepSpeed issue's scenario is a goal, and so is each variant whose requirements no repro before it
    has (a variant with the same requirements is reached by the same scenarios); the survey's combinations after."""
    from zerostate.doctor.dimensions import requirements
    from zerostate.explorer.goals import SURVEY

    table = goals()
    want = []
    for k in KNOWN_ISSUES:
        if k.owner != "deepspeed":
            continue
        want.append(f"known:{k.id}")
        needs = [requirements(r.with_(world_size=max(r.world_size, k.world_size))) for r in (k.scenario, *k.variants)]
        want += [f"known:{k.id}/{i}" for i in range(1, len(needs)) if needs[i] not in needs[:i]]
    assert [g.name for g in table] == want + [f"survey:{name}" for name, _, _ in SURVEY]
    for g in table:
        assert all(g.reached_by(r) for r in g.repros), g.name
    forms = [g for g in table if g.name.startswith("known:two-backwards-per-forward")]
    assert len(forms) > 20 and all(a.needs != b.needs for i, a in enumerate(forms) for b in forms[:i])


def test_a_scenario_without_what_every_repro_needs_does_not_reach_the_goal():
    seed = next(g for g in goals() if g.name == "known:seed-002")
    plain = Scenario.from_dict({"stage": 3, "blocks": [{"checkpoint": "non_reentrant"}]})  # nothing frozen
    assert not seed.reached_by(plain)
    frozen_norm = Block(plain.blocks[0].checkpoint, norm=seed.repros[0].blocks[0].norm)
    assert seed.reached_by(plain.with_(blocks=(frozen_norm,)))


def test_after_the_default_sequence_and_its_completion_every_goal_is_run_and_how_is_said():
    """Every goal ends reached: by a run before the round, by a forced draw (which reaches it), or by its repro; the
    round is deterministic and adds one new example per goal no run reached."""
    ran = list(dict.fromkeys(generated(scenarios(), 200, None)))
    ran += complete(ran, budget_for(200), None).examples
    a, b = reach(ran, None), reach(ran, None)
    assert a.examples == b.examples and a.by_draws == b.by_draws and a.by_repro == b.by_repro
    table = {g.name: g for g in goals()}
    assert sorted(a.by_runs + a.by_round + a.by_draws + a.by_repro) == sorted(table)
    assert len(a.examples) == len(a.by_draws) + len(a.by_repro) and not set(a.examples) & set(ran)
    made = iter(a.examples)
    for g in goals():
        if g.name in a.by_runs:
            assert any(g.reached_by(sc) for sc in ran)
        elif g.name in a.by_round:
            assert any(g.reached_by(sc) for sc in a.examples)
        else:
            sc = next(made)
            assert g.reached_by(sc), g.name
            if g.name in a.by_repro:
                assert sc in g.repros
    # the default sequence leaves families out: the round is what runs them
    assert a.by_draws or a.by_repro


def test_a_goal_the_strategy_cannot_draw_runs_its_repro():
    impossible = Goal("known:x", "x", ({"stage": 5},), (Scenario.from_dict({"stage": 1}),))
    r = reach([], None, [impossible])
    assert r.by_repro == ["known:x"] and r.examples == [Scenario.from_dict({"stage": 1})]


def test_the_forcing_table_names_real_choice_points_and_conflicts_fall_back_to_default_rates():
    from zerostate.doctor.dimensions import BY_NAME
    from zerostate.explorer.choices import BY_NAME as POINTS

    for dim, values in FORCES.items():
        assert dim in BY_NAME
        for want in values.values():
            for point, alts in want.items():
                assert point in POINTS and alts and max(alts) < len(POINTS[point].default), (dim, point)
    assert force_of({"stage": 3, "precision": "bf16"}) is not None
    assert force_of({"reentrant_checkpointing": True, "non_reentrant_checkpointing": True}) is None


def test_the_summary_line_names_the_families_only_their_repro_reached_and_says_when_none_ran():
    from zerostate.cli.cmd_explore import _goals_line

    line = _goals_line({"goals": 42, "reached_by_runs": 33, "reached_by_forced_draws": ["known:a"],
                        "reached_by_another_goals_example": [], "run_as_their_repro": ["known:z3-empty-param"]})
    assert line.startswith("goals: 42 (known-issue families, survey combinations); 33 reached by the examples, 1 by "
                           "a forced draw, 1 only")
    assert "z3-empty-param" in line
    assert "NOT RUN" in _goals_line({"goals": 42, "skipped": "fewer than 100 examples"})
    said = _goals_line({"goals": 2, "reached_by_runs": 1, "reached_by_forced_draws": [], "run_as_their_repro":
                        ["known:seed-002"], "not_run": ["known:seed-002"]})
    assert said.endswith("NOT RUN, so not reached: seed-002 (the target skipped its example, or the exploration "
                         "stopped first)")


@pytest.mark.deepspeed
@pytest.mark.slow
def test_a_deepspeed_exploration_runs_each_goal_no_example_reached_after_its_completion(monkeypatch):
    """Real DeepSpeed, a tiny budget with the goals round let in (`FROM_EXAMPLES` lowered) over two goals: the round's
    examples run (they are in the exploration's runs, at the positions after the completion's) and the result says
    how each goal was reached."""
    from zerostate.explorer import exploration
    from zerostate.explorer import goals as G
    from zerostate.targets.interface import get_target

    table = tuple(g for g in G.goals() if g.name in ("known:seed-002", "known:two-backwards-per-forward"))
    monkeypatch.setattr(exploration, "GOALS_FROM", 1)
    monkeypatch.setattr(exploration, "reach", lambda ran, seed: G.reach(ran, seed, table))
    t = get_target("deepspeed")
    try:
        exp = exploration.Exploration(t, examples=2, seed=1, shrink=False, confirm=False)
        for _ in exp.events():
            pass
    finally:
        t.close()
    res = exp.result()
    assert exp.reach is not None and res.goals is not None and res.goals["goals"] == 2
    assert exp.reach.examples and all(sc in exp.memo for sc in exp.reach.examples)
    done = exp.completion
    assert done is not None
    after = 2 + len(done.examples)
    assert sorted(exp._positions[sc] for sc in exp.reach.examples) == list(
        range(after + 1, after + 1 + len(exp.reach.examples)))
    assert sorted(exp.reach.by_runs + exp.reach.by_round + exp.reach.by_draws + exp.reach.by_repro) == sorted(
        g.name for g in table)


def test_a_skipped_run_reaches_no_goal_and_a_goal_whose_example_was_skipped_is_said_not_run(monkeypatch):
    """The round counts only runs that ran: a target that skips every run of a family (as a release that cannot
    train the scenario does) leaves its goal to the round, and the round's own skipped example leaves it `not_run`.
    The target here is the model target under the DeepSpeed target's name, its outcomes marked skipped for ZeRO-3
    scenarios with non-reentrant checkpointing (the explorer's bookkeeping is what is tested, not DeepSpeed)."""
    from zerostate.explorer import exploration
    from zerostate.explorer import goals as G
    from zerostate.targets.interface import Outcome, Target, get_target

    seed = next(g for g in G.goals() if g.name == "known:seed-002")

    class _SkipsFamily(Outcome):
        @property
        def skipped(self) -> str | None:
            return "not here"

    class _Target(Target):
        name, version = "deepspeed", None

        def __init__(self) -> None:
            self.inner = get_target("model", design="zerostate")

        def run(self, sc: Scenario) -> Outcome:
            out = self.inner.run(sc)
            if seed.reached_by(sc):
                return _SkipsFamily(sc, out.trace, out.error, [])
            return out

    monkeypatch.setattr(exploration, "GOALS_FROM", 1)
    monkeypatch.setattr(exploration, "reach", lambda ran, s: G.reach(ran, s, (seed,)))
    exp = exploration.Exploration(_Target(), examples=30, seed=None, shrink=False, confirm=False)
    for _ in exp.events():
        pass
    assert exp.reach is not None and exp.reach.by_runs == []  # whatever of the family the examples drew was skipped
    assert exp.reach.not_run == ["known:seed-002"]
    assert exp.result().goals["not_run"] == ["known:seed-002"]
