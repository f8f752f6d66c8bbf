"""Hypothesis tests of the gradient-hook / epilogue model.

* A stateful machine draws a scenario and a design, then fires one *enabled*
  driver event at a time (so Hypothesis explores interleavings of the backward
  DAG), checking every hook spec's monitor after every event.
* ``find`` searches for the smallest scenario on which a known-buggy era
  violates its spec, and the test re-checks that counterexample's trace with
  the spec, so it fails if the design were fixed.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, find, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zerostate.model import BackwardKind, Checkpoint, Network, get_design
from zerostate.model.cursor import Cursor
from zerostate.model.events import EventKind
from zerostate.model.explore import state_graph
from zerostate.model.fold import MonitorBank
from zerostate.specs import check_trace
from zerostate.specs.hook_specs import (CLEAN_STEP, COUNT_ONCE_PER_PHASE, EPILOGUE_ONCE, GRAD_HANDLED_ONCE,
                                        HOOK_SPECS)
from zerostate.explorer.strategies import scenarios

CORRECT = ("ds-0.18.7", "zerostate")
hook_scenarios = scenarios(max_blocks=3, max_steps=2, max_gas=2, zero0=False)


def _early_leaf_hook(sc) -> bool:
    """A z3 leaf module with a hook whose input does not require grad (known issue z3-leaf-input-without-grad)."""
    net = Network(sc)
    return any(net.leaf_hook_early(i) and net.leaf_hook_params(i) and net.gradient_reaches_block(i)
               for i in range(len(sc.blocks)))


class HookProtocol(RuleBasedStateMachine):
    """Fire the driver events of one scenario in a Hypothesis-chosen legal order."""

    @initialize(sc=hook_scenarios, name=st.sampled_from(CORRECT))
    def setup(self, sc, name):
        note(sc.describe())
        # ds-0.18.7 keeps DeepSpeed's z3-leaf-input-without-grad (grad-handled-once, handled-before-accumulated)
        assume(name == "zerostate" or not _early_leaf_hook(sc))
        self.cursor = Cursor(get_design(name), sc, coordinator=False)
        self.bank = MonitorBank(HOOK_SPECS)
        self.violation = None

    def _finished(self) -> bool:
        return self.cursor.finished

    @property
    def trace(self):
        return self.cursor.events

    @precondition(lambda self: not self._finished())
    @rule(data=st.data())
    def fire(self, data):
        en = self.cursor.enabled()
        n = data.draw(st.sampled_from(en), label="event") if len(en) > 1 else en[0]
        for sid, (i, failure) in self.bank.feed(self.cursor.fire(n)).items():
            self.violation = self.violation or f"{sid}: {failure.message} at {self.trace[i]}"

    @precondition(lambda self: self._finished())
    @rule()
    def finished(self):
        """The run is over; nothing left to fire."""

    @invariant()
    def every_hook_spec_holds(self):
        assert self.violation is None, self.violation

    def teardown(self):
        if getattr(self, "cursor", None) is not None and self._finished():
            for spec in HOOK_SPECS:
                v = check_trace(spec, self.trace)
                assert v is None, str(v)


TestHookProtocol = HookProtocol.TestCase
TestHookProtocol.settings = settings(stateful_step_count=200)


def _violates(design_name: str, spec, sc) -> bool:
    """Some interleaving of ``sc`` violates ``spec`` under the design (exhaustive over interleavings)."""
    return not state_graph(get_design(design_name), sc, [spec], coordinator=False).holds(spec.id)


def _counterexample(design_name: str, spec, sc):
    return state_graph(get_design(design_name), sc, [spec], coordinator=False).counterexamples.get(spec.id)


def test_ds_0_18_4_premature_epilogue_is_found_and_shrunk():
    """Seed 000 part 1: reentrant checkpoint + PyTorch-style backward loses phase-2 gradients."""
    found = {}

    def seed_shape(sc) -> bool:
        """A reentrant block whose parameters the backward reaches, and a PyTorch-style backward."""
        net = Network(sc)
        return (any(b.checkpoint is Checkpoint.REENTRANT and net.hooked_params(i)
                    for i, b in enumerate(sc.blocks))
                and any(m.backward.pytorch_style for _, _, m in sc.micro_steps()))

    def bad(sc):
        if not seed_shape(sc):
            return False
        for spec in (EPILOGUE_ONCE, GRAD_HANDLED_ONCE):
            if _violates("ds-0.18.4", spec, sc):
                found["spec"] = spec
                return True
        return False

    sc = find(scenarios(max_blocks=3, max_steps=2, max_gas=2, zero0=False), bad,
              settings=settings(derandomize=True, max_examples=2000, database=None))
    assert len(sc.blocks) <= 2 and sc.num_micro_steps <= 2, sc.describe()
    spec = found["spec"]
    events = _counterexample("ds-0.18.4", spec, sc)
    assert check_trace(spec, events) is not None  # the counterexample really violates the spec
    # ... and the fixed designs run the same scenario cleanly
    for name in CORRECT:
        assert not _violates(name, spec, sc)


def test_ds_0_18_4_never_ends_a_pytorch_style_backward_that_reaches_no_hook():
    """A model prediction beyond the seeds: with 0.18.4's counter, the epilogue of a PyTorch-style
    backward runs only from a gradient hook, so a backward that fires none (every reached parameter
    frozen) never runs it and never exits the backward context."""
    from zerostate.model import Block, MicroStep, ParamKind, Scenario, TrainStep
    frozen = Block(norm=ParamKind.FROZEN, lin=ParamKind.FROZEN)
    sc = Scenario(blocks=(frozen,), steps=(TrainStep((MicroStep(BackwardKind.TORCH),)),))
    events = _counterexample("ds-0.18.4", EPILOGUE_ONCE, sc)
    v = check_trace(EPILOGUE_ONCE, events)
    assert v is not None and "without running the epilogue" in v.message
    for name in CORRECT:
        assert not _violates(name, EPILOGUE_ONCE, sc)


def test_ds_0_18_5_counts_in_every_hook():
    """Seed 000 part 2: count_used_parameters_in_backward in every hook (issues #7882, #7885)."""
    sc = find(scenarios(max_blocks=3, max_steps=2, max_gas=2, zero0=False),
              lambda s: _violates("ds-0.18.5", COUNT_ONCE_PER_PHASE, s),
              settings=settings(derandomize=True, max_examples=500, database=None))
    events = _counterexample("ds-0.18.5", COUNT_ONCE_PER_PHASE, sc)
    assert check_trace(COUNT_ONCE_PER_PHASE, events) is not None
    counts = [e for e in events if e.kind is EventKind.COUNT]
    assert len(counts) >= 2 and len({e.task for e in counts}) < len(counts)
    assert len(sc.blocks) == 1 and sc.num_micro_steps == 1, sc.describe()
    for name in CORRECT:
        assert not _violates(name, COUNT_ONCE_PER_PHASE, sc)


def test_stale_bucket_survives_step_in_ds_0_18_4():
    """clean-step (seed 000 part 1): 0.18.4 has no ``_pre_step`` bucket clear, 0.18.5 on does."""
    sc = find(scenarios(max_blocks=2, max_steps=2, max_gas=1, stages=(3,)),
              lambda s: _violates("ds-0.18.4", CLEAN_STEP, s),
              settings=settings(derandomize=True, max_examples=2000, database=None))
    assert check_trace(CLEAN_STEP, _counterexample("ds-0.18.4", CLEAN_STEP, sc)) is not None


@given(hook_scenarios)
@settings(max_examples=80)
def test_count_sees_only_the_current_graph_task(sc):
    """What count_used_parameters_in_backward returns depends on the current graph task's reach:
    the outer task sees plain and non-reentrant blocks, a nested task only its reentrant block."""
    net = Network(sc)
    from zerostate.model.explore import run
    trace = run(get_design("ds-0.18.5"), sc, coordinator=False)
    tasks = {}
    events = list(trace)
    for i, e in enumerate(events):
        if e.kind is EventKind.TASK_START:
            tasks[e.task] = e
        if e.kind is EventKind.COUNT:
            start = tasks[e.task]
            if start.note == "outer":
                reach = net.reach_of_outer_task()
            elif start.note == "nested":
                reach = net.reach_of_nested_task(int(start.module.split(".")[1]))
            else:
                reach = net.reach_of_pre_backward()
            assert e.value == len(reach)  # what the function returns; the expectation adds the leaf modules
            after = events[i + 1]
            assert after.kind is EventKind.EXPECTED and after.value == len(reach) + net.leaf_module_count


@pytest.mark.parametrize("kind", list(BackwardKind))
def test_fixed_designs_hold_on_the_seed_000_shape(kind):
    """Reentrant block then plain block, two train steps, every backward kind: all specs hold."""
    from zerostate.model import Block, MicroStep, Scenario, TrainStep
    sc = Scenario(blocks=(Block(Checkpoint.REENTRANT), Block()),
                  steps=(TrainStep((MicroStep(kind),)),) * 2)
    for name in CORRECT:
        res = state_graph(get_design(name), sc, HOOK_SPECS, coordinator=False)
        assert not res.violations, (name, {k: v.message for k, v in res.violations.items()})


# A gap of the model found on branch issue11-optimizer: the config-Adam draw shifted the default generated
# sequence, and `zerostate explore --target model --design zerostate --examples 15` (test_cli_explore.py
# test_a_correct_design_gives_no_finding) met these two scenarios.  Both have a z3 leaf module whose input does
# not require grad.  The first was the leaf's backward the model did not show (nothing between its pre-backward
# and the task's end: available-when-used judged the leaf at the task's end, after the epilogue released it);
# the model now has each leaf parameter's gradient accumulation (LEAF_GRAD) there, and the zerostate design
# defers the leaf's reduction until those gradients have accumulated (z3-leaf-input-without-grad's fix).
# The second was another known DeepSpeed bug: z3-leaf-kept-gathered (block 0, a z3 leaf whose backward never
# runs, stayed gathered from the second forward on -- measured: without the leaf flag on block 0 the finding
# went, without it on block 1 it stayed); the zerostate coordinator design (and the runtime) now walk each
# later module by its own leaf-ness (leaf_walk_fixed, runtime/leaf_reuse_walk.py).
LEAF_INPUT_NO_GRAD = {
    "available-when-used": {
        "blocks": [{"norm": "frozen", "lin": "frozen"}, {"leaf": True, "in_optimizer": False}, {}],
        "steps": [{"micro": [{"backward": "torch"}]}], "stage": 3, "input_requires_grad": False},
    "released-after-backward": {
        "blocks": [{"norm": "frozen", "lin": "unused", "leaf": True}, {"leaf": True}, {"norm": "frozen"}],
        "steps": [{"micro": [{"backward": "nonscalar"}, {"backward": "engine", "skip": [0, 2]}]}], "stage": 3,
        "input_requires_grad": False},
}


@pytest.mark.parametrize("check", sorted(LEAF_INPUT_NO_GRAD))
def test_zerostate_design_z3_leaf_whose_input_does_not_require_grad(check):
    from zerostate.model.scenario import Scenario
    from zerostate.targets.interface import get_target
    out = get_target("model", design="zerostate").run(Scenario.from_dict(LEAF_INPUT_NO_GRAD[check]))
    assert not out.findings, [f.key for f in out.findings]


def test_zerostate_design_releases_a_z3_leaf_whose_backward_never_runs():
    """z3-leaf-kept-gathered on its own scenario: DeepSpeed's coordinator designs keep the leaf gathered
    after the backward (released-after-backward); the zerostate design releases it after its forward."""
    from zerostate.targets.interface import get_target
    from zerostate.known.issues import Z3_LEAF_KEPT_GATHERED
    sc = Z3_LEAF_KEPT_GATHERED.scenario
    for design in ("ds-0.19.2", "ds-0.19.3"):
        assert "released-after-backward:still-gathered" in {f.violation for f in get_target("model", design=design).run(
            sc).findings}, design
    assert not get_target("model", design="zerostate").run(sc).findings


def _leaf_input_no_grad_scenarios():
    """The known issue's scenario with each backward kind, and the second scenario above without the
    kept-gathered leaf (block 0 plain): each has a z3 leaf with optimizer parameters and no input requiring grad."""
    from zerostate.model.scenario import Scenario
    from zerostate.known.issues import Z3_LEAF_INPUT_NO_GRAD
    out = {}
    for kind in BackwardKind:
        d = Z3_LEAF_INPUT_NO_GRAD.scenario.to_dict()
        d["steps"][0]["micro"][0]["backward"] = kind.value
        out[f"known-{kind.value}"] = Scenario.from_dict(d)
    d = {**LEAF_INPUT_NO_GRAD["released-after-backward"]}
    d["blocks"] = [{**d["blocks"][0], "leaf": False}, *d["blocks"][1:]]
    out["second-without-kept-gathered"] = Scenario.from_dict(d)
    return out


@pytest.mark.parametrize("name", sorted(_leaf_input_no_grad_scenarios()))
def test_leaf_reduction_deferred_until_its_gradients_accumulated(name):
    """z3-leaf-input-without-grad: the leaf hook fires before the leaf's pre-backward.  DeepSpeed's designs
    reduce there (grad-handled-once: handled-before-accumulated, the model's view of the crash); the
    zerostate design reduces the leaf's parameters after the last LEAF_GRAD it awaits, once per backward, and
    judges clean."""
    from zerostate.model.explore import run
    from zerostate.targets.interface import get_target
    sc = _leaf_input_no_grad_scenarios()[name]
    for design in ("ds-0.18.4", "ds-0.18.7", "ds-0.19.3"):
        keys = {f.violation for f in get_target("model", design=design).run(sc).findings}
        assert "grad-handled-once:handled-before-accumulated" in keys, (design, keys)
    assert not get_target("model", design="zerostate").run(sc).findings
    events = run(get_design("zerostate"), sc, coordinator=True).events
    net = Network(sc)
    early = [i for i in range(len(sc.blocks)) if net.leaf_hook_early(i) and net.leaf_pending(i)]
    assert early
    for i in early:
        hook = [k for k, e in enumerate(events) if e.kind is EventKind.LEAF_HOOK and e.module == f"blocks.{i}"]
        pre = [k for k, e in enumerate(events) if e.kind is EventKind.MODULE_PRE_BACKWARD and e.module == f"blocks.{i}"]
        assert hook and len(hook) == len(pre) and all(h < p for h, p in zip(hook, pre, strict=True))  # torch's order
        for p in net.leaf_hook_params(i):
            adds = [k for k, e in enumerate(events) if e.kind is EventKind.BUCKET_ADD and e.param == p]
            grads = [k for k, e in enumerate(events) if e.kind is EventKind.LEAF_GRAD and e.param == p]
            assert len(adds) == len(hook) and all(a > g for a, g in zip(adds, grads, strict=False)), p


# ------------------------------------------------------------------ the hook half's parts, one transition at a time
def test_hook_state_reports_deepspeeds_field_names_and_never_changes_in_place():
    from zerostate.model.hook_state import HookState
    hs = HookState(remaining=2, depth=1, seen=True, fired=3, max_expected=4, cb_queued=True)
    assert hs.observable() == {"remaining_grad_acc_hooks": 2, "backward_active_depth": 1,
                               "backward_seen_this_step": True, "hooks_fired_this_backward": 3,
                               "max_expected_hooks_seen": 4, "post_backward_callback_queued": True}
    assert hs.with_(depth=0).depth == 0 and hs.depth == 1


def test_hook_actions_enter_and_leave_a_backward_as_deepspeeds_methods_do():
    from zerostate.model import hook_actions
    from zerostate.model.hook_state import HookState
    no_ctx = None  # these actions read nothing of the environment
    polluted = HookState(fired=5, max_expected=7, remaining=2, cb_queued=True, cb_task=3)
    hs, eff = hook_actions.enter_backward_resetting(polluted, no_ctx)
    assert (hs.depth, hs.seen, hs.fired, hs.max_expected, hs.remaining, hs.cb_queued) == (1, True, 0, 0, 0, False)
    assert [(e.kind, e.value) for e in eff] == [(EventKind.ENTER_BACKWARD, 1)]
    nested, _ = hook_actions.enter_backward_resetting(hs.with_(fired=2), no_ctx)
    assert (nested.depth, nested.fired) == (2, 2)  # only the step's first entry drops the counters
    plain, _ = hook_actions.enter_backward_plain(polluted, no_ctx)
    assert (plain.depth, plain.fired, plain.seen) == (1, 5, False)  # 0.18.4: depth only
    out, eff = hook_actions.exit_backward(HookState(), no_ctx)
    assert out.depth == 0 and [(e.kind, e.value) for e in eff] == [(EventKind.EXIT_BACKWARD, 0)]  # never below 0
    fresh, eff = hook_actions.reset_for_new_step(HookState(seen=True, fired=4, epilogue_ran=True, cb_task=1), no_ctx)
    assert fresh == HookState() and eff == ()


def test_the_machine_tracks_graph_tasks_and_runs_a_tasks_queued_callback_before_its_end():
    from zerostate.model.events import Event
    from zerostate.model.machine import initial_state, step
    from zerostate.model.scenario import Scenario
    design = get_design("zerostate")
    net = Network(Scenario.from_dict({"blocks": [{}, {}], "stage": 1}))
    st = initial_state(design, net)
    st, trace = step(design, net, st, Event(EventKind.TASK_START, task=0, note="outer"))
    assert trace[0].kind is EventKind.TASK_START
    assert st.env.tasks == ((0, net.reach_of_outer_task()),)
    st = st._replace(env=st.env._replace(callbacks=frozenset({0})))
    st, trace = step(design, net, st, Event(EventKind.TASK_END, task=0))
    kinds = [e.kind for e in trace]
    assert kinds[0] is EventKind.CALLBACK_RUN and kinds.index(EventKind.CALLBACK_RUN) < kinds.index(EventKind.TASK_END)
    assert st.env.tasks == () and st.env.callbacks == frozenset()
