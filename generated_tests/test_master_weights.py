"""bf16: DeepSpeed's fp32 master weights against the mixed-precision oracle's (`oracle_judgement.masters_text`).

The oracle runs bf16 as DeepSpeed does (forward and backward on a bf16 copy, fp32 master weights that start
from the bf16-rounded parameters, fp32 gradient accumulation where the scenario asks for it), so at world
size 1 the two sides' master weights agree to a small share of the update -- where the per-element bf16
tolerance on the 16-bit parameters hides a step that skipped its clipping.  The tolerance is measured on
correct runs, not on faults; `test_fault_kills` shows a fault it sees."""

from __future__ import annotations

import pytest
import torch

from zerostate.findings import oracle_judgement
from zerostate.findings.tolerance import MASTER_RTOL
from zerostate.harness.observe import param_steps
from zerostate.model.scenario import Scenario


def _params(**kw: list[float]) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(v) for n, v in kw.items()}


START = _params(w=[1.0, -1.0, 0.5], b=[0.0, 0.25])
PT = _params(w=[0.9, -0.9, 0.6], b=[0.1, 0.15])


def _observed(start, expected, got):
    """What the worker records of DeepSpeed's master weights ``got`` (both sides began at ``start``)."""
    return param_steps(expected, got, start, start, pt_run_start=start, ds_run_start=start, only_got=True)


def compare_masters(start, expected, got, world_size):
    return oracle_judgement.masters_text(_observed(start, expected, got), world_size)


def master_error(start, expected, got):
    return oracle_judgement.master_error(_observed(start, expected, got))


def test_the_same_master_weights_pass_and_the_error_is_zero():
    assert compare_masters(START, PT, dict(PT), world_size=1)[0] is None
    diff, upd, ds = master_error(START, PT, PT)
    assert diff == 0.0 and upd == pytest.approx(ds) and upd > 0


def test_half_an_update_fails_with_the_norms_in_the_sentence():
    half = {n: START[n] + 0.5 * (PT[n] - START[n]) for n in PT}
    msg, lim = compare_masters(START, PT, half, world_size=1)
    assert msg is not None and "master weights" in msg and lim > 0
    assert master_error(START, PT, half)[0] == pytest.approx(0.5 * master_error(START, PT, PT)[1], rel=1e-5)


def test_noise_is_allowed_by_the_world_size_tolerance():
    """A difference of 5 % of the update: above world size 1's share, inside the share for summed ranks."""
    upd = master_error(START, PT, PT)[1]
    noisy = {n: t.clone() for n, t in PT.items()}
    noisy["w"][0] += 0.05 * upd
    assert MASTER_RTOL[0] < 0.05 < MASTER_RTOL[1]
    assert compare_masters(START, PT, noisy, world_size=1)[0] is not None
    assert compare_masters(START, PT, noisy, world_size=2)[0] is None


def test_only_parameters_deepspeed_keeps_a_master_of_are_compared():
    """A frozen parameter (no master copy on DeepSpeed's side) is left out, not counted as not updated."""
    got = {"w": PT["w"].clone()}
    assert compare_masters(START, PT, got, world_size=1)[0] is None


BF16 = {"precision": "bf16", "steps": [{"micro": [{}, {}]}, {"micro": [{}, {}]}]}
CASES = {
    "z1": {"stage": 1, **BF16},
    "z1-bf16-optimizer": {"stage": 1, "fp32_grad_accum": True, "gradient_clipping": 0.05, **BF16},
    "z2-adam": {"stage": 2, "optimizer": "config-adam", **BF16},
    "z3-clip": {"stage": 3, "gradient_clipping": 1.0, **BF16},
    "z3-zero-init-lora": {"stage": 3, "zero_init": True, "family": "llama", "lora": True, "precision": "bf16",
                          "steps": [{}, {}]},
}


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", sorted(CASES))
def test_master_weights_are_read_every_step_and_agree_on_the_release(ds, name):
    """Each train step's master weights are read (the engine keeps them: ZeRO's optimizers, ``BF16_Optimizer``)
    and compared; on 0.19.8 they agree within world size 1's share (no finding)."""
    sc = Scenario.from_dict(CASES[name])
    out = ds.run(sc)
    masters = [oracle_judgement.master_error(s.masters) for s in out.record.steps if s.masters is not None]
    assert len(masters) == len(sc.steps), out.record
    assert all(u > 0 for _, u, _ in masters), masters
    if ds.version == "0.19.8":
        assert all(d <= MASTER_RTOL[0] * u for d, u, _ in masters), masters
        assert not out.findings, [(f.key, f.error[:200]) for f in out.findings]


@pytest.mark.deepspeed
def test_stage_0_has_no_master_weights_to_compare(ds):
    """ZeRO-0 bf16 steps through ``FP16_Optimizer``, which links no master copy to its parameters: nothing is
    read, and the per-element and update-norm comparisons still judge the run."""
    out = ds.run(Scenario.from_dict({"stage": 0, **BF16}))
    assert all(s.masters is None for s in out.record.steps), out.record
    assert out.steps == 2, out.record


@pytest.mark.deepspeed
def test_a_parameter_with_no_master_copy_is_left_out_and_said_never_a_finding(ds):
    """ZeRO-3's accessor raises KeyError for a parameter that requires grad but is in no optimizer group (it has
    no fp32 partition): zerostate's own probe, so the parameter is left out of the comparison and named in the
    run's details -- never an exception finding about DeepSpeed (found so in the default exploration)."""
    sc = Scenario.from_dict({"stage": 3, "precision": "bf16",
                             "blocks": [{"in_optimizer": False}, {}], "steps": [{}]})
    out = ds.run(sc)
    assert not [f for f in out.findings if f.check == "exception"], [(f.key, f.error[:300]) for f in out.findings]
    unread = dict(out.record.masters_unread)
    assert set(unread) >= {"blocks.0.lin.weight", "blocks.0.lin.bias"}, out.record.masters_unread
    assert all(v.startswith("KeyError") for v in unread.values()), unread
    assert any(s.masters for s in out.record.steps), out.record
