"""A module used in some train steps only (``TrainStep.unused``: a head used at eval, MoE-style routing, a branch per
phase): its trainable parameters get no gradient in those steps, and PyTorch's optimizer leaves them alone there.

On real DeepSpeed (CPU, gloo): ZeRO-1/2 with the client SGD agree with the oracle, and the oracle's numbers change
with the dimension (so agreeing means DeepSpeed skipped the module as PyTorch does); where DeepSpeed does not, the
finding is labelled by the counterfactual that matches it exactly -- ZeRO-3 replays the module's last gradient
(``z3-stale-grad-for-unused-module``), optimizer offload does too (``offload-stale-grad-after-freeze``), Adam over
ZeRO's flat partitions steps it on a zero gradient (``zero-adam-steps-frozen-param``).
"""

from __future__ import annotations

import pytest

from zerostate.harness.net.oracle import oracle_params
from zerostate.known.issues import explain
from zerostate.model.scenario import Scenario, ScenarioError

BASE = {"blocks": [{}, {}], "steps": [{"micro": [{}, {}]}, {"unused": [0], "micro": [{}, {}]},
                                      {"micro": [{}, {}]}]}


def _final(spec: dict) -> dict:
    return oracle_params(Scenario.from_dict(spec))[-1]


def test_the_oracle_leaves_an_unused_module_alone_in_its_step():
    """After step 1 (block 0's Linear unused) the oracle has not moved that Linear, and the run's end differs from the
    same schedule with every module used."""
    sc = Scenario.from_dict({"stage": 2, **BASE})
    steps = oracle_params(sc)
    assert all((steps[1][n] - steps[0][n]).abs().max().item() == 0 for n in steps[0] if n.startswith("blocks.0.lin"))
    assert any((steps[1][n] - steps[0][n]).abs().max().item() > 0 for n in steps[0] if n.startswith("blocks.1."))
    plain = _final({"stage": 2, "blocks": BASE["blocks"], "steps": [{"micro": [{}, {}]}] * 3})
    mine = _final({"stage": 2, **BASE})
    assert any((mine[n] - plain[n]).abs().max().item() > 1e-6 for n in mine)


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_with_sgd_leave_the_unused_module_as_pytorch_does(ds, stage):
    out = ds.run(Scenario.from_dict({"stage": stage, **BASE}))
    assert not out.findings, [(f.key, f.error[:200]) for f in out.findings]
    assert "modules used in some steps only" in (out.agreement or "")


@pytest.mark.deepspeed
@pytest.mark.parametrize("spec, issue", [
    ({"stage": 3}, "z3-stale-grad-for-unused-module"),
    ({"stage": 3, "prefetch_bucket_size": 1000, "persistence_threshold": 8, "width": 7},
     "z3-stale-grad-for-unused-module"),
    ({"stage": 2, "offload": "optimizer"}, "offload-stale-grad-after-freeze"),
    ({"stage": 1, "optimizer": "config-adam"}, "zero-adam-steps-frozen-param"),
])
def test_where_deepspeed_steps_the_unused_module_the_matching_counterfactual_names_it(ds, spec, issue):
    out = ds.run(Scenario.from_dict({**spec, **BASE}))
    oracle = [f for f in out.findings if f.check == "oracle"]
    assert oracle, [(f.key, f.error[:200]) for f in out.findings]
    assert all(explain(f) is not None and explain(f).id == issue for f in oracle), [(f.key, explain(f))
                                                                                   for f in oracle]
    assert not [f for f in out.findings if f.check != "oracle"], [f.key for f in out.findings]


def test_bad_unused_steps_are_named():
    with pytest.raises(ScenarioError, match=r"steps\[0\].unused: block 2"):
        Scenario.from_dict({"blocks": [{}, {}], "steps": [{"unused": [2]}]})
    with pytest.raises(ScenarioError, match="unused"):
        Scenario.from_dict({"blocks": [{"lin": "frozen"}], "steps": [{"unused": [0]}]})
    with pytest.raises(ScenarioError, match="also frozen"):
        Scenario.from_dict({"blocks": [{}], "steps": [{"unused": [0], "frozen": [0]}]})
    with pytest.raises(ScenarioError, match="unused"):
        Scenario.from_dict({"family": "llama", "width": 8, "steps": [{"unused": [0]}]})
