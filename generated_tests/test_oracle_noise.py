"""The oracle measures how much of each element of each update the 16-bit precision leaves undetermined
(`TorchBackend._step_references`, `OracleInfo.noise`, with the arithmetic's own error from `arithmetic_twin`), and
the comparison takes DeepSpeed's difference beyond it, element by element (`observe.param_steps`:
`ParamStep.update_excess_max`).  Plain PyTorch only."""

from __future__ import annotations

import pytest

import torch

from zerostate.findings.tolerance import NOISE_TIMES, rounding_eps
from zerostate.harness.observe import param_steps
from zerostate.harness.net.oracle import OracleInfo, oracle_params
from zerostate.model.scenario import Scenario

pytestmark = pytest.mark.fast


def _run(**kw: object) -> tuple[list, OracleInfo]:
    sc = Scenario.from_dict({"stage": 2, "blocks": [{}, {}], "steps": [{}, {}], **kw})
    info: OracleInfo = {}
    return oracle_params(sc, info), info


def _updates(out: list, info: OracleInfo) -> list[dict[str, float]]:
    starts = [info["initial"], *out[:-1]]
    return [{n: (after[n] - before[n]).abs().max().item() for n in after}
            for before, after in zip(starts, out, strict=True)]


def test_fp32_measures_nothing_and_mixed_precision_every_trained_parameter_at_every_step():
    _, info = _run()
    assert info["noise"] == []
    out, info = _run(precision="bf16")
    assert len(info["noise"]) == len(out) == 2
    assert all(set(n) == set(out[0]) for n in info["noise"])
    assert all(info["noise"][0][n].shape == t.shape for n, t in out[0].items())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_under_sgd_the_noise_is_the_rounding_of_the_gradient_or_its_arithmetic(precision):
    """SGD's update is the gradient times the learning rate: moving the gradient by the unit roundoff times its
    largest element moves the update by that share of the largest update, and by the 16-bit arithmetic's measured
    error where that is more (`arithmetic_twin`): for a two-block network, a few unit roundoffs at most (more would
    blind the comparison: `test_oracle_tolerance` injects 0.9x updates)."""
    out, info = _run(precision=precision)
    u = rounding_eps(Scenario.from_dict({"precision": precision}))
    assert u is not None
    above = 0
    for noise, update in zip(info["noise"], _updates(out, info), strict=True):
        for n, v in noise.items():  # (the fp32 subtraction of the parameters before and after rounds a little)
            assert 0.95 * u * update[n] <= v.max().item() <= 4 * u * update[n], (n, v.max().item() / update[n], u)
            above += v.max().item() > 1.05 * u * update[n]
    assert above, "the arithmetic's error never exceeded the rounding of the result"


def test_the_twin_measures_a_cancelling_sums_error_relative_to_its_terms():
    """Two Linear layers in bf16, two rows whose terms in the first one's weight gradient nearly cancel (opposite
    inputs, output gradients 1 and 1 + 2^-5): each row's gradient through the second layer is rounded to 16 bits
    before the sum over rows, so the weight gradient is off by the unit roundoff times the rows' terms, far more than
    times the (small) result -- what the rounding model alone misses.  The twin's spread is exactly the 16-bit
    gradient's difference from the fp32 one computed here."""
    from zerostate.harness.net.arithmetic_twin import ArithmeticTwin
    from zerostate.model.scenario import BackwardKind
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 1, bias=False)).bfloat16()
    row = torch.randn(1, 4)
    x = torch.cat([row, -row]).bfloat16()
    weights = torch.tensor([1.0, 1.0 + 2 ** -5])

    def loss(res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return res, (res.float().squeeze(1) * weights).sum()
    twin = ArithmeticTwin(lambda m, x, skip: m(x), loss, lambda res, divide: None)
    twin.forward(x, (), {})
    loss(model(x))[1].backward()
    twin.backward(BackwardKind.ENGINE, False, 1.0, 1, 1.0, False, False)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    twin.measure(model, grads, 1.0)
    exact = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    loss(torch.nn.functional.linear(torch.nn.functional.linear(x.float(), exact["0.weight"]),
                                    exact["1.weight"]))[1].backward()
    spread = twin.take()
    for n, g in grads.items():
        assert spread[n].item() == pytest.approx((g.float() - exact[n].grad).abs().max().item(), rel=1e-6)
    g0 = grads["0.weight"].float()
    assert spread["0.weight"].item() > 4 * 2 ** -8 * g0.abs().max().item(), (spread, g0)
    assert twin.take() == {}


def test_under_adam_a_gradient_near_eps_leaves_its_update_undetermined_element_by_element():
    """Adam's first step is about ``lr * g / (|g| + eps)``: an element of a gradient well above the rounding moves
    by the learning rate whatever the rounding, an element within the rounding of zero anywhere in [-lr, lr].  Both
    are in one Linear weight here: its largest noise is most of the learning rate, its typical one a few percent, so
    the noise is taken element by element, never as one figure for the tensor."""
    out, info = _run(precision="bf16", optimizer="config-adam")
    noise, update = info["noise"][0]["blocks.0.lin.weight"], _updates(out, info)[0]["blocks.0.lin.weight"]
    assert noise.max().item() > 0.5 * update and noise.median().item() < 0.05 * update


def test_the_difference_is_taken_beyond_each_elements_noise():
    """An element DeepSpeed moved by less than `NOISE_TIMES` its noise is no difference; the same change on an
    element the precision determines is."""
    start = {"w": torch.zeros(2)}
    pt = {"w": torch.tensor([0.01, 0.01])}
    noise = {"w": torch.tensor([0.004, 0.0])}
    within = param_steps(pt, {"w": torch.tensor([0.01 - 1.5 * 0.004, 0.01])}, start, start, noise=noise)[0]
    beyond = param_steps(pt, {"w": torch.tensor([0.01, 0.01 - 1.5 * 0.004])}, start, start, noise=noise)[0]
    assert within.update_err_max == pytest.approx(beyond.update_err_max) == pytest.approx(0.006)
    assert within.update_excess_max == 0.0 and beyond.update_excess_max == pytest.approx(0.006)
    assert within.noise_max == pytest.approx(0.004) and NOISE_TIMES * 0.004 > 0.006
    assert param_steps(pt, pt, start, start)[0].update_excess_max is None  # fp32: no noise measured


def test_a_counterfactual_reference_measures_the_noise_of_the_gradient_its_mechanisms_made():
    """ZeRO-3 bf16 Adam (eps 1e-3), gas 3, micro-step 0 with two backwards of one forward: dropping its earlier
    backward (`micro0-earlier-backward-lost`) leaves a bias element whose remaining gradient is within the rounding of
    zero although the correct gradient's is not.  That reference's noise is its own gradient's (large on that
    element); it equals the correct reference's noise wherever the mechanism left the gradient as it was."""
    base = {"stage": 3, "precision": "bf16", "optimizer": "config-adam", "input_requires_grad": True, "width": 8,
            "persistence_threshold": 0, "blocks": [{"norm": "frozen"}, {"norm": "frozen"}]}
    sc = Scenario.from_dict({**base, "steps": [{"eval_before": True, "reregister": True, "micro": [
        {"retain": True}, {"skip": [0, 1]}, {"skip": [0, 1]}]}]})
    correct: OracleInfo = {}
    lost: OracleInfo = {}
    oracle_params(sc, correct)
    oracle_params(sc, lost, ("micro0-earlier-backward-lost",))
    name = "blocks.1.lin.bias"
    mine, theirs = lost["noise"][0][name], correct["noise"][0][name]
    i = int((mine - theirs).argmax())
    assert mine[i] > 10 * theirs[i], (mine.tolist(), theirs.tolist())
    same = Scenario.from_dict({**base, "steps": [{"micro": [{}, {}, {}]}]})  # one backward each: nothing dropped
    plain: OracleInfo = {}
    plain_lost: OracleInfo = {}
    oracle_params(same, plain)
    oracle_params(same, plain_lost, ("micro0-earlier-backward-lost",))
    assert all(torch.equal(plain["noise"][0][n], plain_lost["noise"][0][n]) for n in plain["noise"][0])


def test_mechanisms_apply_drops_before_repeats_whatever_their_order():
    """BF16_Optimizer: a retained PyTorch-style backward before the boundary is lost
    (`unexited-backward-lost-before-boundary`), and the boundary's retained backwards add the earlier ones again
    (`earlier-backwards-added-again`): the lost one never reached the accumulation, so it is not added again, in
    whichever order the pair is given (`Mechanism.counts_again`)."""
    sc = Scenario.from_dict({"stage": 1, "precision": "bf16", "fp32_grad_accum": True, "width": 7, "blocks": [{}],
                             "steps": [{"micro": [{"backward": "torch", "retain": True},
                                                  {"backward": "engine", "retain": True}]}]})
    pair = ("unexited-backward-lost-before-boundary", "earlier-backwards-added-again")
    one, other = oracle_params(sc, None, pair), oracle_params(sc, None, pair[::-1])
    alone = oracle_params(sc, None, pair[:1])
    assert all(torch.equal(one[0][n], other[0][n]) for n in one[0])
    assert any(not torch.equal(one[0][n], alone[0][n]) for n in one[0])  # the repeat still acts on the rest


_TWIN_CASES = {
    # DeepSpeed scales the loss after dividing it by gas: in fp16 the product's backward multiplies by 65536, beyond
    # fp16, so the first step overflows and is skipped however small the loss
    "fp16-scale-2^16-gas2": {"stage": 1, "precision": "fp16", "loss_scale_power": 16, "input_requires_grad": True,
                             "blocks": [{}], "steps": [{"micro": [{}, {}]}, {"micro": [{}, {}]}]},
    # reentrant checkpointing differentiates through the input only: the twin's input requires grad as the model's
    "fp16-reentrant-input-grad": {"stage": 3, "precision": "fp16", "input_requires_grad": True,
                                  "blocks": [{"checkpoint": "reentrant"}], "steps": [{}]},
    "bf16-fused-nonscalar-retained": {"stage": 3, "precision": "bf16", "fused_head": True, "outputs": "tuple",
                                      "losses": 2, "blocks": [{}, {}],
                                      "steps": [{"micro": [{"backward": "nonscalar", "retain": True}, {}]},
                                                {"micro": [{"backward": "torch"}, {"backward": "engine"}]}]},
}


@pytest.mark.parametrize("case", sorted(_TWIN_CASES))
def test_the_arithmetic_twin_changes_nothing_the_reference_computes(case, monkeypatch):
    """The twin replays each micro-step on a copy: the reference's parameters and its loss scaler's skips are the
    same with it and without it, and it measured something."""
    from zerostate.harness.net import arithmetic_twin
    sc = Scenario.from_dict(_TWIN_CASES[case])
    with_twin: OracleInfo = {}
    out = oracle_params(sc, with_twin)
    monkeypatch.setattr(arithmetic_twin.ArithmeticTwin, "measure", lambda self, *a, **k: None)
    without: OracleInfo = {}
    bare = oracle_params(sc, without)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(out, bare, strict=True) for n in a)
    assert with_twin.get("skipped") == without.get("skipped")
    if case == "fp16-scale-2^16-gas2":
        assert with_twin["skipped"] == [0], with_twin["skipped"]
    assert any(not torch.equal(with_twin["noise"][i][n], without["noise"][i][n])
               for i in range(len(out)) for n in with_twin["noise"][i])
