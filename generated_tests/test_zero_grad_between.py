"""Separate losses of one retained graph with ``zero_grad`` between them (``MicroStep.zero_grad``): the first
backward keeps the graph, the loop calls ``engine.zero_grad()`` (PyTorch: ``optimizer.zero_grad()``), the second
backward's gradient alone is stepped.  One micro-step per train step (gas 1).

On real DeepSpeed (CPU, gloo): ZeRO stage 0, 1 and 2 in fp32, fp16 and bf16 agree with PyTorch, at one rank and two;
ZeRO-3 crashes on the second backward (two-backwards-per-forward, as without zero_grad); ZeRO-1 bf16 with fp32
gradient accumulation (BF16_Optimizer) keeps the first backward's gradient -- known issue
bf16-optimizer-zero-grad-keeps-fp32-grads, labelled by the counterfactual that ignores the zero_grad.
"""

from __future__ import annotations

import pytest

from zerostate.harness.net.oracle import oracle_params
from zerostate.known.labels import issues_of
from zerostate.model.scenario import Scenario, ScenarioError

_ZG = {"micro": [{"retain": True, "zero_grad": True}]}


def _sc(**more) -> Scenario:
    return Scenario.from_dict({"blocks": [{}, {}], "steps": [_ZG, _ZG], **more})


def test_pytorch_steps_with_the_second_backwards_gradient_alone():
    """SGD's first update is linear in the gradient: with the first half-loss's gradient cleared it is half the
    update of the whole loss (two halves kept, as ``retain`` alone gives, or one backward)."""
    def update(sc: dict) -> dict:
        info: dict = {}
        after = oracle_params(Scenario.from_dict({"blocks": [{}, {}], "stage": 1, **sc}), info)[-1]
        return {n: after[n] - info["initial"][n] for n in after}
    half, whole, one = update({"steps": [_ZG]}), update({"steps": [{"micro": [{"retain": True}]}]}), update({})
    for n in half:
        assert (half[n] * 2 - whole[n]).abs().max().item() < 1e-6, n
        assert (one[n] - whole[n]).abs().max().item() < 1e-6, n
        assert half[n].abs().max().item() > 0, n


@pytest.mark.parametrize("bad", [{"zero_grad": True}, {"retain": True, "zero_grad": "yes"}])
def test_zero_grad_needs_retain_and_gas_1(bad):
    with pytest.raises(ScenarioError, match="zero_grad"):
        Scenario.from_dict({"blocks": [{}], "steps": [{"micro": [bad]}]})
    if bad == {"zero_grad": True}:
        return
    with pytest.raises(ScenarioError, match="zero_grad"):
        Scenario.from_dict({"blocks": [{}], "steps": [{"micro": [{"retain": True, "zero_grad": True}, {}]}]})


def test_the_field_round_trips_and_is_written_only_when_set():
    sc = _sc(stage=1)
    assert Scenario.from_dict(sc.to_dict()) == sc
    assert sc.to_dict()["steps"][0]["micro"][0]["zero_grad"] is True
    assert "zero_grad" not in Scenario.from_dict({"blocks": [{}]}).to_dict()["steps"][0]["micro"][0]
    assert "engine.zero_grad() between them" in sc.describe()


@pytest.mark.deepspeed
@pytest.mark.parametrize("more", [
    {"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 2, "precision": "bf16"},
    {"stage": 1, "precision": "fp16", "optimizer": "config-adam"}, {"stage": 0, "precision": "bf16"},
    {"stage": 2, "world_size": 2}, {"stage": 1, "world_size": 2, "optimizer": "config-adam"},
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_deepspeed_clears_the_first_losss_gradient_as_pytorch_does(ds, more):
    out = ds.run(_sc(**more))
    assert not out.findings, [(f.key, f.error[:300]) for f in out.findings]
    assert out.record is not None and len(out.record.steps) == 2


@pytest.mark.deepspeed
def test_zero3_crashes_on_the_second_backward_as_without_zero_grad(ds):
    out = ds.run(_sc(stage=3))
    assert out.findings and {k.id for f in out.findings for k in issues_of(f)} == {"two-backwards-per-forward"}, \
        [(f.key, [k.id for k in issues_of(f)]) for f in out.findings]


@pytest.mark.deepspeed
def test_bf16_optimizer_keeps_the_first_losss_gradient(ds):
    """BF16_Optimizer moved the first backward's gradient into its fp32 buffer at once; engine.zero_grad() does not
    reach it: DeepSpeed steps with twice PyTorch's gradient, exactly what the counterfactual says."""
    out = ds.run(_sc(stage=1, precision="bf16", fp32_grad_accum=True))
    (f,) = out.findings
    assert f.check == "oracle" and f.evidence.explained_by == ("zero-grad-not-in-fp32-accumulation",), f.key
    assert [k.id for k in issues_of(f)] == ["bf16-optimizer-zero-grad-keeps-fp32-grads"]
