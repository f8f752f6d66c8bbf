"""The explorer the deepspeed target is driven by (explorer/exploration.py), exercised on the model target.

Fast (no DeepSpeed): determinism, shrinking, the example budget, findings handed over as they are
final, a broken target, Ctrl-C.
"""

from __future__ import annotations

import pytest

from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Target, get_target
from zerostate.findings.finding import Finding
from zerostate.explorer.ahead import Ahead
from zerostate.explorer.exploration import Exploration, explore, hard_cap
from zerostate.explorer.simplify import distance_from_simplest
from zerostate.explorer.strategies import scenarios

CORE = scenarios(setup=False)
"""The model target's tests draw the hook/coordinator core the model judges (no training-setup dimension):
they test the explorer, not the default strategy, whose derandomized sequence shifts with every dimension
added to it (test_scenario.py checks what the default sequence draws)."""

ONE_STEP = scenarios(max_steps=1, setup=False)
"""The core in one train step: the tests of the order findings are shrunk in, which need every key shrunk.  With
one finding per fingerprint, CORE's short explorations show more keys than their hard cap shrinks: the cap hands
the rest over as seen (the exploration's designed end), so those tests draw fewer keys instead."""


def test_deterministic_and_shrunk():
    t = get_target("model", design="ds-0.18.4")
    runs = [explore(t, examples=60, seed=None) for _ in range(2)]
    keys = [{f.key: f.scenario for f in r.findings} for r in runs]
    assert keys[0] == keys[1] and keys[0]
    for f in runs[0].findings:  # 0.18.4's double count needs plain, reentrant, plain: 3 blocks is minimal
        assert len(f.scenario.blocks) <= 3 and len(f.scenario.steps) <= 2, f.scenario.describe()
    # no epilogue at all needs one block and one step (hook-after-epilogue needs a plain block after a reentrant one)
    epi = next(f for f in runs[0].findings if f.violation == "epilogue-once:no-epilogue")
    assert len(epi.scenario.blocks) == 1 and len(epi.scenario.steps) == 1, epi.scenario.describe()


def test_findings_are_handed_over_as_they_come_and_progress_is_reported():
    t = get_target("model", design="ds-0.18.5")
    got, progress = [], []
    res = explore(t, examples=60, seed=None, on_finding=got.append,
                  on_progress=lambda n, k, s: progress.append((n, k)))
    assert [f.key for f in got] == [f.key for f in res.findings]
    assert "count-once-per-phase" in {f.check for f in got}
    assert progress and progress[-1][0] == res.examples <= hard_cap(60)


def test_stop_and_seed():
    t = get_target("model", design="ds-0.18.5")
    res = explore(t, examples=60, seed=1234, stop=bool)
    assert len({f.key for f in res.findings}) >= 1


class _Broken(Target):
    name, version = "broken", None

    def __init__(self, after: int, exc: BaseException):
        self.n, self.after, self.exc = 0, after, exc
        self.inner = get_target("model", design="ds-0.18.4")

    def run(self, sc: Scenario) -> Outcome:
        self.n += 1
        if self.n > self.after:
            raise self.exc
        return self.inner.run(sc)


def test_a_broken_target_stops_the_run_with_its_own_error():
    with pytest.raises(RuntimeError, match="worker cannot restart"):
        explore(_Broken(3, RuntimeError("worker cannot restart")), examples=50, seed=None)


def test_ctrl_c_hands_over_what_was_seen():
    got: list[Finding] = []
    with pytest.raises(KeyboardInterrupt):
        explore(_Broken(40, KeyboardInterrupt()), examples=200, seed=None, on_finding=got.append)
    assert got


# ------------------------------------------------------------------ confirmation before hand-over
class _Leaky(Target):
    """A test-only target whose worker leaks state (the knob lives here, not in the production worker):
    once it has run a ZeRO-1 scenario, every later scenario with two or more train steps gets a
    ``leaked`` finding, until ``fresh()`` starts a clean worker.  Like a rank pool carrying a collective
    over, or DeepSpeed carrying state from one engine to the next in one process."""

    name, version = "leaky", None
    can_refresh = True

    def __init__(self):
        self.inner = get_target("model", design="zerostate")
        self.poisoned = False
        self.fresh_starts = 0
        self.restarts = 0

    def fresh(self) -> None:
        self.poisoned, self.fresh_starts = False, self.fresh_starts + 1

    def run(self, sc: Scenario) -> Outcome:
        out = self.inner.run(sc)
        if self.poisoned and len(sc.steps) >= 2:
            out.findings.append(Finding("leaked", "state left over by an earlier example", sc, target=self.name))
        if sc.stage == 1:
            self.poisoned = True
        return out


def test_a_finding_that_needs_earlier_examples_is_reported_order_dependent_with_its_sequence():
    from zerostate.explorer.confirm import reproduces
    runs = [explore(_Leaky(), examples=30, seed=None) for _ in range(2)]
    leaked = [next(f for f in r.findings if f.check == "leaked") for r in runs]
    c = leaked[0].confirmation
    assert c.status == "order-dependent", c
    # the shortest run that makes it appear: one ZeRO-1 example (what poisons the worker)
    assert len(c.sequence) == 1 and c.sequence[0].stage == 1, [s.describe() for s in c.sequence]
    # its replay reproduces it: in a fresh worker after the sequence, and not alone
    assert reproduces(_Leaky(), leaked[0].key, leaked[0].scenario, c.sequence)
    assert not reproduces(_Leaky(), leaked[0].key, leaked[0].scenario, [])
    assert runs[0].reliability["order_dependent"] == 1
    # the same seed gives the same findings, sequences included
    same = [{f.key: (f.scenario, f.confirmation.sequence) for f in r.findings} for r in runs]
    assert same[0] == same[1]


def test_findings_that_reproduce_alone_are_confirmed():
    res = explore(get_target("model", design="ds-0.18.4"), examples=40, seed=None, strategy=CORE)
    assert res.findings and all(f.confirmation.status == "confirmed" for f in res.findings)
    rel = res.reliability
    assert rel["confirmed"] == rel["reported"] == len(res.findings) and rel["restarts"] == []


def test_a_stop_leaves_the_findings_after_it_as_seen_and_unconfirmed():
    """``stop``: the caller has what it wanted -- the findings it stopped on are shrunk and confirmed, the
    others stay as handed over (unshrunk, not checked), and the reliability figure says so."""
    res = explore(get_target("model", design="ds-0.18.4"), examples=40, seed=None, strategy=CORE,
                  stop=lambda fs: len(fs) >= 2)
    done = [f for f in res.findings if f.shrunk]
    assert len(done) == 2 and all(f.confirmation.status == "confirmed" for f in done)
    rest = [f for f in res.findings if not f.shrunk]
    assert rest and all(f.confirmation.status == "not-checked" for f in rest)
    rel = res.reliability
    assert rel["confirmed"] == 2 and rel["not_checked"] == len(rest)


class _Restarting(_Leaky):
    """Restarts its worker after every 7th run (as a hang or ranks out of step would)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def run(self, sc: Scenario) -> Outcome:
        out = super().run(sc)
        self.n += 1
        if self.n % 7 == 0:
            self.restarts += 1
            self.poisoned = False
            out.pool_restarted = "test: restarted after this example"
        return out


def test_worker_restarts_are_counted_with_their_reason_and_cut_the_history():
    seen = []
    res = explore(_Restarting(), examples=40, seed=None, on_restart=seen.append)
    assert res.restarts and seen == res.restarts
    assert all(r["why"] == "test: restarted after this example" for r in res.restarts)
    for f in res.findings:  # a sequence never reaches back over a restart
        assert len(f.confirmation.sequence) <= 6


class _Racy(_Leaky):
    """A race (test-only): a ``raced`` finding on every 5th run of a two-step scenario, counted over the
    target's whole life (a fresh worker does not reset it: nothing is carried over, it is timing)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def run(self, sc: Scenario) -> Outcome:
        out = self.inner.run(sc)
        self.n += 1
        if len(sc.steps) >= 2 and self.n % 5 == 0:
            out.findings.append(Finding("raced", "a race lost", sc, target=self.name))
        return out


def test_a_finding_that_shows_in_some_runs_only_is_reported_intermittent_with_its_rate():
    from zerostate.explorer.confirm import REPEAT, confirm
    two = Scenario.from_dict({"blocks": [{}], "steps": [{"micro": [{"backward": "engine"}]}] * 2})
    one = Scenario.from_dict({"blocks": [{}], "steps": [{"micro": [{"backward": "engine"}]}]})
    t = _Racy()
    # run 1 alone: no; run 2-3 its history then it: no; then 100 runs alone: every 5th
    c = confirm(t, Finding("raced", "a race lost", two).key, two, [one])
    assert c.status == "intermittent" and c.repeat == REPEAT and c.hits == REPEAT // 5, c
    assert c.to_dict()["hits"] == c.hits


# ------------------------------------------------------------------ hand-over unshrunk, jobs
def test_each_new_key_is_handed_over_unshrunk_at_once_then_updated_shrunk():
    """The first generated example of each new key is handed over as it runs (unshrunk); its shrunk
    finding follows as an update with the same key (confirmation pending), then the confirmed one."""
    got, updates, progress = [], [], []
    res = explore(get_target("model", design="ds-0.18.4"), examples=10, seed=None, strategy=ONE_STEP,
                  on_finding=got.append,
                  on_update=lambda f: updates.append((f.key, f.confirmation and f.confirmation.status, f)),
                  on_progress=lambda n, k, s: progress.append(n))
    assert res.examples < hard_cap(10), res.examples  # the cap handed nothing over as seen: every key shrinks
    assert len(got) >= 3 and all(f.shrunk is False for f in got)
    assert [f.key for f in got] == [f.key for f in res.findings]  # one hand-over per key, in order
    for f in res.findings:
        mine = [(status, g) for key, status, g in updates if key == f.key]
        assert [status for status, _ in mine] == [None, "confirmed"], mine  # shrunk, then confirmed
        assert mine[-1][1] is f and f.shrunk is True
        first = next(g for g in got if g.key == f.key).scenario  # no further from the simplest scenario, in
        # the order shrinking follows
        assert distance_from_simplest(f.scenario) <= distance_from_simplest(first), (f.scenario, first)
        assert res.seconds_to[f.key] <= res.seconds_final[f.key]
    # handed over during generation: the first key after fewer distinct runs than the whole generation took
    assert min(res.first_seen.values()) < progress[-1]


def _keys(res):
    return {f.key: (f.scenario, f.confirmation.status, f.confirmation.sequence) for f in res.findings}


def test_the_same_findings_whatever_the_number_of_jobs():
    one = explore(get_target("model", design="ds-0.18.5"), examples=60, seed=None, strategy=CORE, jobs=1, lane=20)
    two = explore(get_target("model", design="ds-0.18.5"), examples=60, seed=None, strategy=CORE, jobs=2,
                  spawn=lambda: get_target("model", design="ds-0.18.5"), lane=20)
    assert _keys(one) and _keys(one) == _keys(two)
    assert one.generated_at == two.generated_at


@pytest.mark.parametrize("cap", [None, 90])  # 90 distinct runs: the hard cap ends shrinking before every key is shrunk
def test_helpers_search_the_keys_next_in_line_ahead_and_the_findings_stay_those_of_one_job(cap, monkeypatch):
    """Shrinking is one pass over the keys in order; with helper workers the searches of the keys next in line run
    ahead on them (`explorer.ahead`) and the pass records their runs as its own.  The helpers made some of the
    pass's runs, and the findings, the distinct runs counted against the cap and where in the generated sequence each
    key was first met are those of one job."""
    from zerostate.explorer import exploration
    if cap is not None:
        monkeypatch.setattr(exploration, "hard_cap", lambda examples: cap)

    def run(jobs: int, ahead: bool = True) -> Exploration:
        exp = Exploration(get_target("model", design="ds-0.18.5"), examples=60, seed=None, strategy=CORE,
                          jobs=jobs, spawn=lambda: get_target("model", design="ds-0.18.5"), lane=20,
                          search_ahead=ahead)
        for _ in exp.events():
            pass
        return exp
    one, two, control = run(1), run(2), run(2, ahead=False)
    assert one.ahead is None and isinstance(two.ahead, Ahead) and control.ahead is None
    assert _keys(control.result()) == _keys(two.result())
    by_helper = [sc for sc, r in two.ahead.ran.items() if r.worker == 1 and sc in two.memo]
    assert by_helper, "no run of the pass was made ahead on the helper"
    a, b = one.result(), two.result()
    assert _keys(a) and _keys(a) == _keys(b)
    assert (a.examples, a.generated_at) == (b.examples, b.generated_at)
    shrunk = {f.key: f.shrunk for f in a.findings}
    assert shrunk == {f.key: f.shrunk for f in b.findings}
    assert (a.examples == cap and not all(shrunk.values())) if cap else all(shrunk.values()), (a.examples, shrunk)


def test_carried_state_gives_the_same_findings_whatever_the_number_of_jobs():
    """An order-dependent finding depends on what ran before it in its worker: each lane of generated
    examples runs in a worker started fresh for it, so its history is the same with 1, 2 or 3 jobs."""
    made = []

    def spawn():
        made.append(_Leaky())
        return made[-1]

    runs = [explore(_Leaky(), examples=50, seed=None, jobs=j, spawn=spawn, lane=20) for j in (1, 2, 3)]
    assert any(f.check == "leaked" for f in runs[0].findings)
    assert _keys(runs[0]) == _keys(runs[1]) == _keys(runs[2])
    assert len(made) == 3  # jobs 2 and 3 made one and two more workers


def test_first_shrinks_the_chosen_keys_before_the_others():
    """``first`` (explore: the findings no known issue explains): those keys are shrunk before every other
    key, whatever the order their first generated examples came in; without it, generation order."""
    plain: list[str] = []
    res = explore(get_target("model", design="ds-0.18.4"), examples=10, seed=None, strategy=ONE_STEP, confirm=False,
                  on_update=lambda f: plain.append(f.key))
    # every key shrunk, so the keys met while shrinking do not depend on the order the cap would cut
    assert res.examples < hard_cap(10), res.examples
    keys = list(dict.fromkeys(plain))
    generated = sorted(res.generated_at, key=res.generated_at.get)  # the keys the generated sequence shows
    assert len(generated) >= 3, res.generated_at
    chosen = generated[-1]  # the last of them to be shrunk in generation order
    assert keys.index(chosen) > 0, keys
    got: list[str] = []
    explore(get_target("model", design="ds-0.18.4"), examples=10, seed=None, strategy=ONE_STEP, confirm=False,
            on_update=lambda f: got.append(f.key), first=lambda f: f.key == chosen)
    assert next(iter(dict.fromkeys(got))) == chosen, (keys, got)
    assert sorted(set(got)) == sorted(set(keys))


def test_polish_takes_out_training_setup_dimensions_the_finding_does_not_need():
    """A setup dimension that Hypothesis cannot shrink away (here added to every scenario after drawing; in
    explore, a key first seen while shrinking another keeps the scenario it was seen in) is taken out by
    polish when the finding does not need it: the model ignores clipping, re-registration and checkpoints."""
    from zerostate.model.scenario import TrainStep
    from zerostate.explorer.strategies import scenarios
    strat = scenarios(max_blocks=2, max_steps=2, max_gas=2, setup=False).map(
        lambda s: s.with_(gradient_clipping=0.05, steps=tuple(TrainStep(st.micro, st.eval_before, True,
                                                                         save_load=True) for st in s.steps)))
    res = explore(get_target("model", design="ds-0.18.4"), examples=30, seed=None, strategy=strat, confirm=False,
                  stop=lambda fs: len(fs) >= 3)  # the ones it stops on are shrunk and simplified, before the run cap
    done = [f for f in res.findings if f.shrunk]
    assert len(done) >= 3
    for f in done:
        assert f.scenario.gradient_clipping == 0.0 and not any(st.reregister for st in f.scenario.steps), \
            f.scenario.to_json(None)


def test_polish_takes_out_the_config_optimizer_the_finding_does_not_need():
    """``optimizer`` is not a `Scenario.beyond_model` dimension, yet polish counts it
    (``simplify.distance_from_simplest``) and puts the client SGD back when the finding does not need DeepSpeed's
    config Adam (the model ignores it)."""
    from zerostate.model.scenario import Optimizer
    from zerostate.explorer.strategies import scenarios
    strat = scenarios(max_blocks=2, max_steps=2, max_gas=2, setup=False).map(
        lambda s: s.with_(optimizer=Optimizer.CONFIG_ADAM))
    res = explore(get_target("model", design="ds-0.18.4"), examples=30, seed=None, strategy=strat, confirm=False,
                  stop=lambda fs: len(fs) >= 3)  # the ones it stops on are shrunk and simplified, before the run cap
    done = [f for f in res.findings if f.shrunk]
    assert len(done) >= 3
    for f in done:
        assert f.scenario.optimizer is Optimizer.SGD, f.scenario.to_json(None)
        assert not any(st.save_load for st in f.scenario.steps), f.scenario.to_json(None)


# ------------------------------------------------------------------ the stream of typed events
def test_the_stream_numbers_each_key_and_hands_it_over_seen_shrunk_confirmed():
    import dataclasses

    from zerostate.explorer.exploration_events import Confirmed, Progress, Seen, Shrunk, Stage
    from zerostate.explorer.exploration import Exploration
    exp = Exploration(get_target("model", design="ds-0.18.5"), examples=10, strategy=CORE)
    events = list(exp.events())
    seen = [e for e in events if isinstance(e, Seen)]
    assert seen and [e.n for e in seen] == list(range(1, len(seen) + 1))
    for s in seen:  # per key, in this order: Seen (unshrunk), Shrunk (pending), Confirmed, all one number
        mine = [e for e in events if isinstance(e, (Seen, Shrunk, Confirmed)) and e.key == s.key]
        assert [type(e) for e in mine] == [Seen, Shrunk, Confirmed] and {e.n for e in mine} == {s.n}
        assert mine[0].stage is Stage.UNSHRUNK and not mine[0].finding.shrunk
        assert mine[1].finding.confirmation is None and mine[2].finding.confirmation.status == "confirmed"
    runs = [e.examples_run for e in events if isinstance(e, Progress)]
    assert runs == list(range(1, exp.result().examples + 1))  # one Progress per distinct run
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen[0].n = 7  # type: ignore[misc]


def test_closing_the_stream_stops_it_at_once_with_the_findings_as_handed_over():
    from zerostate.explorer.exploration_events import Progress, Seen
    from zerostate.explorer.exploration import Exploration
    t = _Broken(10 ** 6, RuntimeError("never"))
    exp = Exploration(t, examples=60, strategy=CORE)
    stream = exp.events()
    first = next(e for e in stream if isinstance(e, Seen))
    runs = t.n
    stream.close()
    res = exp.result()
    assert t.n == runs == res.examples  # not one run more
    assert [f.key for f in res.findings] == [first.key]  # what was handed over, and nothing after it
    assert all(not f.shrunk and f.confirmation.status == "not-checked" for f in res.findings)
    assert not res.stopped
    assert not any(isinstance(e, Progress) for e in stream)  # a closed stream yields nothing more


def test_a_stop_request_ends_at_the_next_run_and_confirms_what_was_seen_as_seen():
    from zerostate.explorer.exploration_events import Progress
    from zerostate.explorer.exploration import Exploration
    exp = Exploration(get_target("model", design="ds-0.18.4"), examples=60, strategy=CORE)
    for ev in exp.events():
        if isinstance(ev, Progress) and ev.findings:
            at = ev.examples_run
            exp.request_stop()
    res = exp.result()
    assert res.stopped and res.examples == at
    assert res.findings and all(not f.shrunk and f.confirmation.status == "confirmed" for f in res.findings)


def test_shrinking_does_not_depend_on_the_machines_speed(monkeypatch):
    """Hypothesis stops shrinking after 300 s of wall clock; on a machine slow enough for every shrink to pass
    that limit (simulated: a limit of 0 s) the explorer still ends on the same findings and scenarios."""
    from hypothesis.internal.conjecture import engine
    runs = [explore(get_target("model", design="ds-0.18.4"), examples=20, seed=None, strategy=CORE, confirm=False)]
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 0)
    runs.append(explore(get_target("model", design="ds-0.18.4"), examples=20, seed=None, strategy=CORE, confirm=False))
    assert _keys(runs[0]) and _keys(runs[0]) == _keys(runs[1])
    assert runs[0].examples == runs[1].examples
