"""The loop's own ``deepspeed.zero.GatheredParameters`` (``TrainStep.gather``): a read of every parameter (TRL's weight
sync to vLLM, a callback logging norms) and an edit of a trained weight the way DeepSpeed documents it (the 16-bit
weight under ``modifier_rank=0``, its fp32 master with ``safe_set_full_fp32_param``), between steps or between a
backward and ``engine.step()``.

PyTorch: a read changes nothing, an edit changes the parameter the optimizer steps.  On real DeepSpeed (CPU, gloo)
ZeRO-1/2/3 keep the edit, at one rank and two, in fp32 and bf16; stage 0's fp16/bf16 optimizers keep fp32 masters the
tensor-fragment API cannot reach, so the edit is gone at the next step -- labelled by the counterfactual that edits the
16-bit copy only (``stage0-mixed-master-not-settable``).  ZeRO-3's tracer sees the context (USER_GATHER), and a
persistent parameter it partitions on exit is the context's release, not a module hook's.
"""

from __future__ import annotations

import pytest

from zerostate.findings.oracle_judgement import differences
from zerostate.findings.record import Generation, StepObservation
from zerostate.harness.net.oracle import oracle_params
from zerostate.harness.rank_pool import RAISED_GRACE
from zerostate.known.labels import issues_of
from zerostate.model.events import Event, EventKind
from zerostate.model.scenario import Gather, Scenario, ScenarioError
from zerostate.specs import check_trace
from zerostate.specs.persistence_specs import PERSISTENT_RESIDENT

def _spec(stage: int, gather: str, inside: bool = False, **more) -> dict:
    last = {"micro": [{}, {}], "gather": gather, **({"gather_inside": True} if inside else {})}
    return {"stage": stage, "blocks": [{}, {}], "steps": [{"micro": [{}, {}]}, last, {"micro": [{}, {}]}], **more}


def _plain(stage: int) -> dict:
    return {"stage": stage, "blocks": [{}, {}], "steps": [{"micro": [{}, {}]}] * 3}


def _moved(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_the_oracle_keeps_an_edit_and_a_read_changes_nothing():
    plain = oracle_params(Scenario.from_dict(_plain(2)))
    read = oracle_params(Scenario.from_dict(_spec(2, "read")))
    assert _moved(plain[-1], read[-1]) == 0.0
    edit = oracle_params(Scenario.from_dict(_spec(2, "edit")))
    assert _moved(plain[0], edit[0]) == 0.0  # before the edit, the same run
    assert _moved(plain[-1], edit[-1]) > 1e-3
    inside = oracle_params(Scenario.from_dict(_spec(2, "edit", inside=True)))
    assert _moved(edit[-1], inside[-1]) > 1e-6  # between steps, the step's forwards use the edit; inside, not


@pytest.mark.deepspeed
@pytest.mark.parametrize("spec", [
    _spec(1, "edit"), _spec(2, "edit", inside=True), _spec(3, "edit"), _spec(3, "edit", inside=True),
    _spec(2, "edit", precision="bf16"), _spec(3, "edit", precision="bf16", persistence_threshold=8, width=7),
    _spec(3, "read", inside=True, persistence_threshold=8, width=7, prefetch_bucket_size=1000),
    _spec(3, "edit", world_size=2), _spec(3, "read", world_size=2, precision="bf16"), _spec(1, "edit", world_size=2),
    _spec(0, "edit"),
], ids=lambda s: f"z{s['stage']}-{s['steps'][1]['gather']}{'-inside' if s['steps'][1].get('gather_inside') else ''}"
                 f"-{s.get('precision', 'fp32')}-ws{s.get('world_size', 1)}")
def test_deepspeed_keeps_what_pytorch_does(ds, spec):
    out = ds.run(Scenario.from_dict(spec))
    assert not out.findings, [(f.key, f.error[:300]) for f in out.findings]
    assert out.record is not None and out.record.steps, "the run compared no step"
    if spec["steps"][1]["gather"] == "read":  # "ok" needs an observation: the read was compared
        assert len(out.record.reads) == out.record.oracle_reads == 1
        assert out.record.reads[0].want_shape == out.record.reads[0].got_shape and out.record.reads[0].want_max > 0


def test_a_read_that_differs_from_pytorchs_parameters_is_a_difference():
    sc = Scenario.from_dict(_spec(3, "read"))
    steps = [StepObservation(0, ()), StepObservation(1, (), reads=1), StepObservation(2, (), reads=1)]
    same = (Generation((130,), (130,), 0.0, 1.0),)
    assert not differences(steps, (), 0, None, sc, same, 1)
    for bad in (Generation((130,), (130,), 0.5, 1.0), Generation((130,), (0,), 0.0, 0.0)):
        found = differences(steps, (), 0, None, sc, (bad,), 1)
        assert [(d.kind, d.step) for d in found] == [("read", 1)], found
        assert "GatheredParameters read in train step 1" in found[0].message
    assert differences(steps, (), 0, None, sc, same, 0)  # a read PyTorch did not make


@pytest.mark.deepspeed
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_stage0_mixed_precision_loses_the_edit_and_the_counterfactual_names_it(ds, precision):
    out = ds.run(Scenario.from_dict({"stage": 0, "precision": precision, "steps": [{}, {"gather": "edit"}]}))
    oracle = [f for f in out.findings if f.check == "oracle"]
    assert oracle, [(f.key, f.error[:200]) for f in out.findings]
    assert all("edit-not-in-master" in f.key for f in oracle), [f.key for f in oracle]
    assert all("stage0-mixed-master-not-settable" in {i.id for i in issues_of(f)} for f in oracle), \
        [(f.key, [i.id for i in issues_of(f)]) for f in oracle]


@pytest.mark.deepspeed
def test_zero3_at_two_ranks_crashes_the_last_rank_on_an_unpadded_master_and_the_hang_is_named_by_it(ds):
    """49 elements at two ranks: ``set_full_hp_param`` narrows past the value's end on rank 1, rank 0 waits in the
    next forward's collective.  The pool gives the waiting rank `RAISED_GRACE`, not the step timeout, and the finding
    is rank 1's exception, labelled by its fingerprint -- not an anonymous ``hang``."""
    out = ds.run(Scenario.from_dict({"stage": 3, "world_size": 2, "width": 7, "steps": [{}, {"gather": "edit"}]}))
    assert [f.check for f in out.findings] == ["exception"], [(f.key, f.error[:200]) for f in out.findings]
    assert [i.id for i in issues_of(out.findings[0])] == ["z3-set-full-fp32-param-unpadded"]
    assert out.pool_restarted and "hang after a rank's exception" in out.pool_restarted
    assert f"no report within {RAISED_GRACE:.0f} s" in out.pool_restarted  # the grace applied, not the step timeout


@pytest.mark.deepspeed
def test_zero3_traces_the_context_and_its_persistent_releases_are_not_a_hooks(ds):
    out = ds.run(Scenario.from_dict(_spec(3, "read", inside=True, persistence_threshold=8, width=7)))
    kinds = [(e.kind, e.note) for e in out.trace if e.kind is EventKind.USER_GATHER]
    assert kinds == [(EventKind.USER_GATHER, "enter"), (EventKind.USER_GATHER, "exit")], kinds
    enter = next(i for i, e in enumerate(out.trace) if e.kind is EventKind.USER_GATHER)
    leave = enter + 1 + next(i for i, e in enumerate(out.trace[enter + 1:]) if e.kind is EventKind.USER_GATHER)
    persistent = {e.param for e in out.trace if e.kind is EventKind.PERSISTENT}
    released = {e.param for e in out.trace[enter:leave] if e.kind is EventKind.RELEASE}
    assert persistent and persistent <= released  # the context partitions the persistent parameters on exit
    assert not out.findings, [f.key for f in out.findings]


def _resident(events: list[Event]):
    return check_trace(PERSISTENT_RESIDENT, events)


def test_a_persistent_release_inside_the_loops_gather_is_not_a_hooks():
    head = [Event(EventKind.PERSISTENT, param="b.w"), Event(EventKind.TRACE_STATE, note="COMPLETE"),
            Event(EventKind.FORWARD_START)]
    inside = [Event(EventKind.USER_GATHER, note="enter"), Event(EventKind.RELEASE, param="b.w"),
              Event(EventKind.USER_GATHER, note="exit"), Event(EventKind.STEP, value=0)]
    bare = [Event(EventKind.RELEASE, param="b.w"), Event(EventKind.STEP, value=0)]
    assert not _resident(head + inside)
    assert _resident(head + bare)  # the same release by a hook fails


def test_gather_fields_round_trip_and_bad_ones_are_named():
    sc = Scenario.from_dict(_spec(3, "edit", inside=True))
    assert sc.steps[1].gather is Gather.EDIT and sc.steps[1].gather_inside
    assert Scenario.from_json(sc.to_json(None)) == sc
    assert "gather" not in Scenario.from_dict(_plain(3)).to_json(None)  # files without it stay as they were
    assert any("GatheredParameters" in d for d in sc.beyond_model())
    assert not Scenario.from_dict(_spec(2, "edit")).beyond_model()  # below ZeRO-3 the context does nothing
    with pytest.raises(ScenarioError, match="gather"):
        Scenario.from_dict({"steps": [{"gather": "write"}]})
    with pytest.raises(ScenarioError, match="gather_inside"):
        Scenario.from_dict({"steps": [{"gather_inside": True}]})
    with pytest.raises(ScenarioError, match="an edit needs"):
        Scenario.from_dict({"blocks": [{"lin": "frozen"}], "steps": [{"gather": "edit"}]})
    with pytest.raises(ScenarioError, match="an edit needs"):
        Scenario.from_dict({"family": "llama", "width": 8, "steps": [{"gather": "edit"}]})
