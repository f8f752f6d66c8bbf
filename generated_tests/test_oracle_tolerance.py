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


def _scenario(precision: str, world_size: int, optimizer: str) -> Scenario:
    return Scenario.from_dict({"stage": 2, "precision": precision, "blocks": [{}, {}], "steps": [{}, {}],
                               "world_size": world_size, "optimizer": optimizer})


def _missed_by_the_oracle(target, sc: Scenario, cases: dict) -> list[str]:
    """The run unperturbed must train and agree with PyTorch; then each case's error injected: the names of those
    no oracle finding caught."""
    target.perturb = ()
    clean = target.run(sc)
    assert not clean.skipped and clean.steps == 2, clean.skipped
    assert not clean.findings, [(f.key, f.error[:200]) for f in clean.findings]
    missed = []
    for name, perturb in cases.items():
        target.perturb = perturb
        try:
            out = target.run(sc)
        finally:
            target.perturb = ()
        if not any(f.check == "oracle" for f in out.findings):
            missed.append(name)
    return missed


@pytest.mark.parametrize("optimizer", ["sgd", "config-adam"])  # Adam: the tolerance widened by the measured noise
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_every_injected_error_is_caught_and_the_run_itself_agrees(target, precision, world_size, optimizer):
    sc = _scenario(precision, world_size, optimizer)
    missed = _missed_by_the_oracle(target, sc, CASES)
    assert not missed, f"{precision} at world size {world_size}, {optimizer}: not caught: {missed}"


_LLAMA = "model.layers.0."
LLAMA_CASES = {
    "one projection x2": ((f"{_LLAMA}self_attn.q_proj.weight", 2.0),),
    "one RMSNorm update lost": ((f"{_LLAMA}post_attention_layernorm.weight", 0.0),),
    "every update 0.9x": (("*", 0.9),),
    "every update 1.1x": (("*", 1.1),),
}
"""On a llama the 16-bit arithmetic's measured error (`arithmetic_twin`) is largest: up to a few percent of an
update in bf16, against a fraction of one on the plain network."""


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("optimizer", ["sgd", "config-adam"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_every_injected_error_is_caught_on_a_llama(target, precision, optimizer, lora):
    """A tiny llama, all its weights or PEFT's LoRA adapters trained, ZeRO-3: the same kinds of error as on the
    plain network, where the noise the oracle measures is widest (a cancelling sum over the tokens)."""
    sc = Scenario.from_dict({"stage": 3, "family": "llama", "lora": lora, "precision": precision,
                             "optimizer": optimizer, "steps": [{}, {}]})
    cases = dict(LLAMA_CASES)
    if lora:  # the base weights are frozen: the adapters' updates instead
        cases["one projection x2"] = ((f"base_model.model.{_LLAMA}self_attn.q_proj.lora_A.default.weight", 2.0),)
        cases.pop("one RMSNorm update lost")
    missed = _missed_by_the_oracle(target, sc, cases)
    assert not missed, f"llama ({'LoRA' if lora else 'full'}) {precision}, {optimizer}: not caught: {missed}"


NOISE_FINDINGS = {
    # ZeRO-3 bf16 llama + LoRA under zero.Init, tied embeddings, config Adam: lora_B's gradient elements are ~1e-8,
    # Adam's eps, so its first update of them is any share of the learning rate (0.58x against DeepSpeed's 0.55x)
    "lora-near-eps": {"stage": 3, "precision": "bf16", "family": "llama", "lora": True, "zero_init": True,
                      "tie": True, "optimizer": "config-adam", "persistence_threshold": 0, "width": 8,
                      "steps": [{"micro": [{"backward": "engine"}]}]},
    # world size 2, bf16, config Adam, a fused head and a tied weight at gas 2: the fp32 master of a parameter or two
    # a little off (each rank's bf16 gradient rounded before the ranks' sum); documented as unexplained until the
    # oracle measured the noise (the retired UNEXPLAINED entry "bf16-ranks-rounding" of test_deepspeed_target.py)
    "ws2-bf16-ranks-rounding": {"stage": 1, "precision": "bf16", "fused_head": True, "tie": True,
                                "optimizer": "config-adam", "world_size": 2, "seed": 0,
                                "steps": [{"micro": [{}, {}]}]},
    # ZeRO-1 bf16 with fp32 accumulation at world size 4, config Adam, one retained backward
    "ws4-bf16-adam": {"stage": 1, "precision": "bf16", "fp32_grad_accum": True, "world_size": 4, "width": 7,
                      "optimizer": "config-adam", "max_reuse_distance": 128,
                      "steps": [{"micro": [{"backward": "engine", "retain": True}]}]},
}


def _without_noise(record):
    """``record`` as the oracle judged it before it measured the noise: every update's whole difference counts."""
    from dataclasses import replace

    def bare(params):
        return None if params is None else tuple(replace(p, update_excess_max=None) for p in params)
    return replace(record, steps=tuple(replace(s, params=bare(s.params), masters=bare(s.masters))
                                       for s in record.steps))


@pytest.mark.parametrize("name", sorted(NOISE_FINDINGS))
def test_an_update_the_precision_does_not_determine_is_noise_not_a_finding(target, name):
    """Oracle findings of 0.19.8 that no mechanism explained (the default exploration's two, master weights 1-2 %
    off in norm, one element a few percent of the learning rate; the world-size-2 one documented as unexplained):
    Adam's update of a gradient element near its ``eps`` is undetermined by a 16-bit gradient.  Judged beyond each
    element's measured noise they agree; the same run's record judged on the whole difference (as before the noise
    was measured) reads as a difference."""
    from zerostate.findings.oracle_judgement import verdict
    sc = Scenario.from_dict(NOISE_FINDINGS[name])
    target.perturb = ()
    out = target.run(sc)
    assert not [f.key for f in out.findings] and out.record is not None
    assert verdict(out.record, sc) is None
    assert verdict(_without_noise(out.record), sc) is not None
