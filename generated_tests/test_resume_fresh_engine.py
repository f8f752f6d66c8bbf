"""HF Trainer's ``resume_from_checkpoint`` into a fresh engine (``TrainStep.resume``): the engine saves a DeepSpeed
checkpoint and is destroyed, the model is built again as before training, a fresh ``deepspeed.initialize`` (same
config, a new client optimizer and scheduler) loads the checkpoint and trains on.  PyTorch: nothing changes.

On real DeepSpeed (CPU, gloo) every stage resumes what the oracle expects -- master weights, Adam's state, a scheduler
DeepSpeed steps, ZeRO-3's persistent parameters and leaf modules, at one rank and two, a LoRA llama.  The tracer
follows the fresh engine (ENGINE_START): every spec's monitor starts over there, so the old engine's trace and hook
state are not held against the new one, and an obligation the old engine left open is judged at the switch.
"""

from __future__ import annotations

import pytest

from zerostate.findings.decide import decide
from zerostate.findings.record import Counters, ExceptionRecord, ResumeObservation, RunRecord
from zerostate.harness.net.oracle import oracle_params
from zerostate.model.events import Event, EventKind
from zerostate.model.scenario import Scenario, ScenarioError
from zerostate.specs import check_trace
from zerostate.specs.hook_specs import EPILOGUE_ONCE
from zerostate.specs.persistence_specs import PERSISTENT_RESIDENT


def _resumed(**more) -> dict:
    return {"blocks": [{}, {}], "steps": [{"micro": [{}, {}]}, {"resume": True, "micro": [{}, {}]}], **more}


def test_the_oracle_is_unchanged_by_a_resume():
    plain = oracle_params(Scenario.from_dict({"stage": 2, "blocks": [{}, {}], "steps": [{"micro": [{}, {}]}] * 2}))
    resumed = oracle_params(Scenario.from_dict(_resumed(stage=2)))
    assert all(all((a[n] - b[n]).abs().max().item() == 0 for n in a) for a, b in zip(plain, resumed, strict=True))


@pytest.mark.deepspeed
@pytest.mark.parametrize("spec", [
    _resumed(stage=0), _resumed(stage=1), _resumed(stage=2), _resumed(stage=3),
    _resumed(stage=1, optimizer="config-adam"), _resumed(stage=3, optimizer="config-adam"),
    _resumed(stage=2, precision="bf16"), _resumed(stage=1, scheduler="initialize"),
    _resumed(stage=3, width=7, persistence_threshold=8, prefetch_bucket_size=1000,
             blocks=[{"checkpoint": "non_reentrant"}, {"leaf": True}]),
    _resumed(stage=3, world_size=2), _resumed(stage=1, world_size=2, optimizer="config-adam"),
    {"stage": 3, "family": "llama", "lora": True, "steps": [{}, {"resume": True}]},
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items() if k not in ("blocks", "steps")))
def test_deepspeed_trains_on_from_the_checkpoint_as_pytorch_does(ds, spec):
    out = ds.run(Scenario.from_dict(spec))
    assert not out.findings, [(f.key, f.error[:300]) for f in out.findings]
    assert out.record is not None and len(out.record.steps) == len(spec["steps"]), "no step after the resume compared"
    (resumed,) = out.record.resumes  # what the resume itself showed: judged, not only kept
    assert resumed.loaded and resumed.destroy_error is None and resumed.counters_after == resumed.counters_before
    assert resumed.counters_before is not None and resumed.counters_before.global_steps == 1
    if spec["stage"] == 3 and spec.get("world_size", 1) == 1:
        assert [e.kind for e in out.trace].count(EventKind.ENGINE_START) == 1


def test_a_fresh_engine_restarts_every_monitor_and_closes_what_the_old_one_left_open():
    open_backward = [Event(EventKind.USER_BACKWARD_START, note="engine"), Event(EventKind.ENGINE_START)]
    v = check_trace(EPILOGUE_ONCE, open_backward)
    assert v is not None and v.index == 1  # judged at the switch, not carried into the new engine
    head = [Event(EventKind.PERSISTENT, param="b.w"), Event(EventKind.TRACE_STATE, note="COMPLETE"),
            Event(EventKind.FORWARD_START)]
    release = [Event(EventKind.FORWARD_START), Event(EventKind.RELEASE, param="b.w"), Event(EventKind.STEP, value=1)]
    assert check_trace(PERSISTENT_RESIDENT, head + release[1:])  # within one engine: a violation
    assert not check_trace(PERSISTENT_RESIDENT, head + [Event(EventKind.ENGINE_START)] + release)  # a new engine's


def test_resume_fields_round_trip_and_bad_ones_are_named():
    sc = Scenario.from_dict(_resumed(stage=3))
    assert sc.steps[1].resume and Scenario.from_json(sc.to_json(None)) == sc
    assert "resume" not in Scenario.from_dict({"stage": 3}).to_json(None)
    assert any("fresh engine" in d for d in sc.beyond_model())
    with pytest.raises(ScenarioError, match=r"steps\[0\].resume"):
        Scenario.from_dict({"steps": [{"resume": True}]})
    with pytest.raises(ScenarioError, match="not with save_load"):
        Scenario.from_dict({"steps": [{}, {"resume": True, "save_load": True}]})
    with pytest.raises(ScenarioError, match="resume"):
        Scenario.from_dict({"steps": [{}, {"resume": "yes"}]})


@pytest.mark.parametrize("resume,teardown,raised,expected", [
    (ResumeObservation(1, True, None, Counters(1, 0), Counters(1, 0)), None, False, []),
    (ResumeObservation(1, False, None, Counters(1, 0), Counters(0, 0)), None, False,
     [("checkpoint", "resume-not-loaded")]),
    (ResumeObservation(1, True, None, Counters(1, 0), Counters(0, 0)), None, False,
     [("checkpoint", "resume-counters")]),
    (ResumeObservation(1, True, None, Counters(1, 0, 8.0), Counters(1, 0, 65536.0)), None, False,
     [("checkpoint", "resume-counters")]),
    (ResumeObservation(1, True, "AttributeError: x", Counters(1, 0), Counters(1, 0)), None, False,
     [("teardown", "destroy-raised")]),
    (None, "RuntimeError: y", False, [("teardown", "destroy-raised")]),
    (None, "RuntimeError: y", True, [("exception", "")]),  # a broken engine's teardown proves nothing
])
def test_what_a_resume_and_a_teardown_showed_is_judged(resume, teardown, raised, expected):
    """A resume that loaded nothing, that did not restore the counters, an ``engine.destroy()`` that raised (at the
    resume or at the end of a run that did not raise): each a finding of its own, not a record nobody reads."""
    record = RunRecord(resumes=(resume,) if resume else (), teardown_error=teardown,
                       raised=ExceptionRecord("RuntimeError: boom", "tb") if raised else None)
    got = [(d.check, d.code) for d in decide(record, Scenario.from_dict(_resumed(stage=2)))]
    assert got == expected, got
