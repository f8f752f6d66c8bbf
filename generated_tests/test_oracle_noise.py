"""The oracle measures how much of each element of each update the 16-bit precision leaves undetermined
(`TorchBackend._noise`, `OracleInfo.noise`), and the comparison takes DeepSpeed's difference beyond it, element by
element (`observe.param_steps`: `ParamStep.update_excess_max`).  Plain PyTorch only."""

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
def test_under_sgd_the_noise_is_the_rounding_of_the_gradient(precision):
    """SGD's update is the gradient times the learning rate: moving the gradient by the unit roundoff times its
    largest element moves the update by that share of the largest update, no more."""
    out, info = _run(precision=precision)
    u = rounding_eps(Scenario.from_dict({"precision": precision}))
    assert u is not None
    for noise, update in zip(info["noise"], _updates(out, info), strict=True):
        for n, v in noise.items():  # (the fp32 subtraction of the parameters before and after rounds a little)
            assert 0 < v.max().item() <= 1.05 * u * update[n], (n, v.max().item(), update[n])


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
