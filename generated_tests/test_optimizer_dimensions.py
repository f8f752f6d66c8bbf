"""The optimizer dimensions trainers add around the engine, on real DeepSpeed (CPU, gloo): an LR scheduler over the
client optimizer (``scheduler``: passed to ``deepspeed.initialize`` or stepped by the loop) and HF Trainer's two
parameter groups (``decay_groups``), one of them empty under LoRA.

Each is shown to reach DeepSpeed and its oracle: the oracle's numbers with the dimension differ from those without
it (or between its two forms), so agreeing with the oracle means DeepSpeed applied it as PyTorch does; the
empty-group case is the known issue ``empty-param-group-dropped-under-scheduler`` (a strict expected failure in
test_deepspeed_target.py::test_known_issue), and without a scheduler the same groups train as PyTorch does.
"""

from __future__ import annotations

import pytest

from zerostate.harness.net import config, torch_network
from zerostate.harness.net.oracle import oracle_params
from zerostate.known.issues import by_id, explain
from zerostate.model.scenario import Scenario, ScenarioError

pytestmark = pytest.mark.deepspeed

STEPS3 = [{"micro": [{"backward": "engine"}, {"backward": "torch"}]}] * 3


def _final(spec: dict) -> dict:
    return oracle_params(Scenario.from_dict(spec))[-1]


def _differs(a: dict, b: dict) -> bool:
    pa, pb = _final(a), _final(b)
    return any((pa[n] - pb[n]).abs().max().item() > 1e-6 for n in pa)


CASES = {
    "z0-initialize": {"stage": 0, "scheduler": "initialize",
                      "steps": [{"micro": [{"backward": "engine"}, {"backward": "engine"}]}] * 3},
    "z1-user": {"stage": 1, "scheduler": "user", "blocks": [{}, {}], "steps": STEPS3},
    "z2-initialize-offload": {"stage": 2, "scheduler": "initialize", "offload": "optimizer", "steps": STEPS3},
    "z3-initialize": {"stage": 3, "scheduler": "initialize", "blocks": [{}, {}], "steps": STEPS3},
    "z3-user-bf16": {"stage": 3, "scheduler": "user", "precision": "bf16", "steps": STEPS3},
    # DeepSpeed builds the optimizer: the scheduler is a callable of it, as HF Trainer passes one
    "z2-initialize-config-adam": {"stage": 2, "scheduler": "initialize", "optimizer": "config-adam",
                                  "steps": STEPS3},
    "z1-groups-initialize": {"stage": 1, "scheduler": "initialize", "decay_groups": True, "blocks": [{}, {}],
                             "steps": STEPS3},
    "llama-lora-z3-initialize-config-adam": {"stage": 3, "family": "llama", "lora": True, "decay_groups": True,
                                             "scheduler": "initialize", "optimizer": "config-adam",
                                             "steps": [{}, {}, {}]},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scheduler_reaches_deepspeed_and_agrees(ds, name):
    """A run with a scheduler agrees with the oracle's (which steps the same schedule where PyTorch would), and the
    schedule changes the oracle's numbers, so the agreement is evidence DeepSpeed applied it."""
    spec = CASES[name]
    sc = Scenario.from_dict(spec)
    out = ds.run(sc)
    assert not out.skipped, out.skipped
    assert not out.findings, "\n".join(f"{f.key}: {f.error[:300]}" for f in out.findings)
    assert out.steps == len(sc.steps), out.record
    assert _differs(spec, {**spec, "scheduler": "none"}), f"{name}: the scheduler does not change the oracle"


def test_an_overflow_tells_the_two_schedulers_apart(ds):
    """fp16 at DeepSpeed's initial scale: step 0 overflows and is skipped.  DeepSpeed steps a scheduler it was given
    only with an applied step, the loop steps its own after every ``engine.step()``: the oracle models both (their
    numbers differ), and DeepSpeed agrees with each."""
    base = {"stage": 2, "precision": "fp16", "loss_scale_power": 16, "steps": [{"micro": [{"backward": "engine"}]}] * 3}
    handed, user = {**base, "scheduler": "initialize"}, {**base, "scheduler": "user"}
    info: dict = {}
    oracle_params(Scenario.from_dict(handed), info)
    assert info["skipped"] == [0], info
    assert _differs(handed, user)
    for spec in (handed, user):
        out = ds.run(Scenario.from_dict(spec))
        assert not out.findings, "\n".join(f"{f.key}: {f.error[:300]}" for f in out.findings)
        assert out.record.loss_scaling.ds_skipped == 1, out.record.loss_scaling


def test_hf_groups_reach_deepspeed(ds):
    """HF Trainer's two groups: the engine's optimizer holds both (weights; biases and norms) and training agrees
    with the oracle; with LoRA the no-decay group is empty, DeepSpeed drops it, and without a scheduler nothing
    depends on it: the run agrees too."""
    sc = Scenario.from_dict({"stage": 1, "decay_groups": True, "blocks": [{}, {}], "steps": STEPS3})
    groups = config.param_groups(sc, torch_network.build_model(sc))
    assert [len(g["params"]) for g in groups] == [2, 6], [len(g["params"]) for g in groups]
    out = ds.run(sc)
    assert not out.findings, [(f.key, f.error[:200]) for f in out.findings]
    assert len(out.record.engine.optimizer.groups) == 2, out.record.engine.optimizer
    lora = Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "decay_groups": True,
                               "steps": [{}, {}]})
    assert lora.empty_group
    groups = config.param_groups(lora, torch_network.build_model(lora))
    assert [bool(g["params"]) for g in groups] == [True, False]
    out = ds.run(lora)
    assert not out.findings, [(f.key, f.error[:200]) for f in out.findings]
    assert len(out.record.engine.optimizer.groups) == 1, out.record.engine.optimizer


@pytest.mark.parametrize("stage, scheduler", [(3, "initialize"), (3, "user"), (0, "initialize")])
def test_an_empty_group_under_a_client_scheduler_is_the_known_issue(ds, stage, scheduler):
    """The same LoRA groups with a scheduler built over the client optimizer: DeepSpeed's in-place removal of the
    empty group leaves the scheduler a rate too many, and its first step raises -- labelled by the issue's evidence
    (the strict zip in torch's ``_update_lr``), in engine.step() or in the loop.  At stage 0 the step's context is
    what the trace could not see (no gradient hook to watch there), never "no gradient" (met unlabelled, so keyed,
    in a default exploration)."""
    sc = Scenario.from_dict({"stage": stage, "family": "llama", "lora": True, "decay_groups": True,
                             "scheduler": scheduler, "steps": [{}, {}]})
    out = ds.run(sc)
    crashes = [f for f in out.findings if f.check == "exception"]
    assert crashes, [(f.key, f.error[:200]) for f in out.findings]
    issue = by_id("empty-param-group-dropped-under-scheduler")
    assert all(explain(f) is issue for f in crashes), [(f.key, explain(f)) for f in crashes]
    assert out.steps == 0
    if stage == 0 and scheduler == "initialize":
        assert [f.key.rsplit("@", 1)[1] for f in crashes] == ["step/gradient-unobserved"]


def test_the_scheduler_leaves_the_trace_unchanged(ds):
    """Why ``scheduler`` is model-neutral (not a `Scenario.beyond_model` dimension): the hook and coordinator events
    are the same with and without it."""
    spec = {"stage": 3, "blocks": [{}, {}], "steps": STEPS3}
    plain, sched = ds.run(Scenario.from_dict(spec)), ds.run(Scenario.from_dict({**spec, "scheduler": "initialize"}))
    assert plain.trace and [e.to_dict() for e in sched.trace] == [e.to_dict() for e in plain.trace]
    assert sched.agreement is None and not sched.findings, (sched.agreement, sched.findings)


def test_bad_optimizer_dimensions_are_named():
    with pytest.raises(ScenarioError, match="scheduler"):
        Scenario.from_dict({"scheduler": "cosine"})
    with pytest.raises(ScenarioError, match="scheduler: 'user'"):
        Scenario.from_dict({"scheduler": "user", "optimizer": "config-adam"})
    with pytest.raises(ScenarioError, match="decay_groups"):
        Scenario.from_dict({"decay_groups": True, "param_groups": 2})
    with pytest.raises(ScenarioError, match="decay_groups"):
        Scenario.from_dict({"decay_groups": "yes"})
