"""The oracle judges the update, in every dtype, at every world size: an error injected into a real run's update
(on top of that run's own noise) is caught -- one parameter x2, one LayerNorm update lost, every update 0.9x, 1.1x
or 2x -- at fp32, fp16 and bf16 and world size 1, 2 and 4, and the same runs without it agree with PyTorch.

The error is injected where the worker observes DeepSpeed's parameters (`executor.Perturbation`): DeepSpeed
trains as it does, its update of the chosen parameters (and of their fp32 master weights) is seen multiplied by
the factor."""

from __future__ import annotations

import pytest

import zerostate.targets  # noqa: F401 -- registers the target kinds
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import get_target

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

CASES = {
    "one parameter x2": (("blocks.0.lin.weight", 2.0),),
    "one LayerNorm update lost": (("blocks.1.norm.weight", 0.0),),
    "every update 0.9x": (("*", 0.9),),
    "every update 1.1x": (("*", 1.1),),
    "every update 2x": (("*", 2.0),),
}


@pytest.fixture(scope="module")
def target():
    t = get_target("deepspeed")
    yield t
    t.close()


def _scenario(precision: str, world_size: int) -> Scenario:
    return Scenario.from_dict({"stage": 2, "precision": precision, "blocks": [{}, {}], "steps": [{}, {}],
                               "world_size": world_size})


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_every_injected_error_is_caught_and_the_run_itself_agrees(target, precision, world_size):
    sc = _scenario(precision, world_size)
    target.perturb = ()
    clean = target.run(sc)
    assert not clean.skipped and clean.steps == 2, clean.skipped
    assert not clean.findings, [(f.key, f.error[:200]) for f in clean.findings]
    missed = []
    for name, perturb in CASES.items():
        target.perturb = perturb
        try:
            out = target.run(sc)
        finally:
            target.perturb = ()
        if not any(f.check == "oracle" for f in out.findings):
            missed.append(name)
    assert not missed, f"{precision} at world size {world_size}: not caught: {missed}"
