"""Checkpoint save/load between train steps (``TrainStep.save_load``) on real DeepSpeed (CPU, gloo,
world size 1).

Before a ``save_load`` step the engine saves a checkpoint and loads it back, as HF Trainer does every
``save_steps`` and on resume; at ZeRO-3 it first builds the consolidated 16-bit state dict HF saves the model
with.  the executor records the round trip (`executor.round_trip_record`) and
`checkpoint_judgement.round_trip_problem` judges it (the ``checkpoint`` check); the oracle judges the training
after it.  Here: the checkpoint really happens (files written, a checkpoint loaded, the state dicts built and
compared, the directory removed), and DeepSpeed agrees with the oracle across the dimensions users combine it
with; the comparison itself is shown to fail on records that differ.  ZeRO-1 with frozen parameters and a
parameter in no optimizer group are known issues (zero_to_fp32 leaves them out: test_deepspeed_target.py's
``test_known_issue``).
"""

from __future__ import annotations

import os

import pytest
import torch

from zerostate.model.scenario import Scenario
from zerostate.findings.checkpoint_judgement import round_trip_problem
from zerostate.findings.tolerance import ATOL, RTOL
from zerostate.harness.executor import round_trip_record
from zerostate.harness.net import config
from zerostate.harness.net.oracle import oracle_params

ONE, TWO = [{}], [{}, {"save_load": True}]
CASES = {
    "z0": {"stage": 0, "steps": TWO},
    "z0-bf16": {"stage": 0, "precision": "bf16", "steps": TWO},
    "z1": {"stage": 1, "steps": TWO},
    "z2": {"stage": 2, "blocks": [{}, {"norm": "frozen"}], "steps": TWO},
    "z3": {"stage": 3, "blocks": [{"checkpoint": "non_reentrant"}, {"norm": "frozen"}], "steps": TWO},
    "z3-first-step": {"stage": 3, "persistence_threshold": 8, "steps": [{"save_load": True}]},
    "z2-offload": {"stage": 2, "offload": "optimizer", "steps": TWO},
    "z3-offload-both": {"stage": 3, "offload": "both", "blocks": [{}, {}], "steps": TWO},
    "z1-bf16": {"stage": 1, "precision": "bf16", "blocks": [{}, {}], "steps": TWO},
    "z2-fp16": {"stage": 2, "precision": "fp16", "steps": TWO},
    "z2-bf16-frozen": {"stage": 2, "precision": "bf16", "blocks": [{"lin": "frozen"}, {}], "steps": TWO},
    "z3-bf16": {"stage": 3, "precision": "bf16", "persistence_threshold": 8, "blocks": [{}, {}], "steps": TWO},
    "z3-fp16-skip": {"stage": 3, "precision": "fp16", "loss_scale_power": 16, "steps": TWO + [{}]},
    "z3-tie": {"stage": 3, "tie": True, "blocks": [{}, {}], "steps": TWO},
    "llama-lora-z3": {"family": "llama", "lora": True, "stage": 3, "blocks": [{"checkpoint": "non_reentrant"}],
                      "steps": TWO},
    "llama-lora-z2": {"family": "llama", "lora": True, "stage": 2, "steps": TWO},
}


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", sorted(CASES))
def test_save_load_happens_and_agrees(ds, name):
    """Each ``save_load`` step saved a checkpoint (its files), loaded one (the path load_checkpoint returns)
    from a directory that is gone afterwards, built ZeRO-3's 16-bit state dict and zero_to_fp32's fp32 weights
    over every parameter; on 0.19.8 nothing disagrees (an older release's finding must be a known issue's or a
    seed bug's)."""
    from zerostate.known.issues import SEED_BUGS, explain
    documented = lambda f: explain(f) is not None or any(p(f) for _, p in SEED_BUGS.values())  # noqa: E731
    sc = Scenario.from_dict(CASES[name])
    out = ds.run(sc)
    assert not out.skipped, out.skipped
    explained = all(documented(f) for f in out.findings)
    if out.error is not None and ds.version != "0.19.8":  # an older release's known exception before the checkpoint
        assert explained, [(f.key, f.error[:300]) for f in out.findings]
        return
    recs = out.record.checkpoints
    assert [r.step for r in recs] == [i for i, s in enumerate(sc.steps) if s.save_load], recs
    names = sorted(oracle_params(sc, info := {}) and info["initial"])
    for r in recs:
        assert "latest" in r.files and any(f.startswith(f"global_step{r.step}/") for f in r.files), r
        top = r.loaded.split(os.sep + f"global_step{r.step}")[0]
        assert os.path.basename(top).startswith("zerostate-ckpt-") and not os.path.exists(top), r.loaded
        assert (r.state16 is not None) == (sc.stage == 3), r
        assert r.state16 is None or set(names) <= set(r.state16), (names, r.state16)
        assert (r.fp32 is not None) == (sc.stage > 0), r
        assert r.fp32 is None or set(names) <= set(r.fp32), (names, r.fp32)
    assert all(documented(f) for f in out.findings), [(f.key, f.error[:300]) for f in out.findings]
    if ds.version == "0.19.8":
        assert not out.findings, [(f.key, f.error[:300]) for f in out.findings]
    if name == "z3-fp16-skip":  # the loss scaler's state crossed the round trip: a step skipped before it
        fp16 = out.record.loss_scaling
        assert fp16.ds_skipped >= 1 and fp16.pt_skipped == (0,), fp16


def test_save_load_without_a_checkpoint_step_saves_nothing():
    """The config asks for the 16-bit save only when a step checkpoints (ZeRO-3)."""
    z = lambda steps: config.ds_config(Scenario.from_dict({"stage": 3, "steps": steps}))["zero_optimization"]  # noqa: E731
    assert z(TWO).get("stage3_gather_16bit_weights_on_model_save") is True
    assert "stage3_gather_16bit_weights_on_model_save" not in z(ONE)


# ----------------------------------------------------- the comparison itself (no DeepSpeed)
def _record(**over):
    p = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[0.5]])}
    rec = {"step": 1, "files": ["latest", "global_step1/x.pt"], "loaded": "/tmp/x/global_step1/x.pt",
           "before": p, "after": {k: v.clone() for k, v in p.items()}, "state16": {k: v.clone() for k, v in p.items()},
           "fp32": {k: v.clone() for k, v in p.items()}, "fp32_exact": True,
           "counters": [{"global_steps": 1, "skipped_steps": 0, "loss_scale": None}] * 2}
    rec.update(over)
    return rec, {k: v.clone() for k, v in p.items()}


def compare_save_load(rec, oracle, tol):
    """The worker's record of the round trip ``rec``, judged (``oracle`` None: training already disagreed)."""
    observed = round_trip_record(rec, oracle if oracle is not None else rec["before"])
    return round_trip_problem(observed, tol, against_oracle=oracle is not None)


def _nudged(d, key="a"):
    out = {k: v.clone() for k, v in d.items()}
    out[key] = torch.nextafter(out[key], torch.full_like(out[key], 10.0))
    return out


def test_compare_save_load_passes_a_faithful_round_trip():
    rec, oracle = _record()
    assert compare_save_load(rec, oracle, (ATOL, RTOL)) is None


@pytest.mark.parametrize("code", ["no-files", "not-loaded", "16-bit-state-dict", "round-trip", "counters",
                                  "zero-to-fp32", "master-weights"])
def test_compare_save_load_fails_each_check(code):
    """Each check fails on a record that differs from a faithful one in its own part only: one ulp off the
    engine's parameters (exact checks), a missing parameter, another counter, no files, nothing loaded."""
    rec, oracle = _record()
    bad = {"no-files": {"files": []}, "not-loaded": {"loaded": None},
           "16-bit-state-dict": {"state16": _nudged(rec["state16"])},
           "round-trip": {"after": _nudged(rec["after"], "b")},
           "counters": {"counters": [rec["counters"][0], {**rec["counters"][0], "loss_scale": 128.0}]},
           "zero-to-fp32": {"fp32": {"a": rec["fp32"]["a"]}},
           "master-weights": {"master": rec["fp32"], "master_after": _nudged(rec["fp32"], "b")}}[code]
    rec.update(bad)
    got = compare_save_load(rec, oracle, (ATOL, RTOL))
    assert got is not None and got[0] == code and "checkpoint before train step 1" in got[1], got


def test_compare_save_load_master_weights_must_be_the_saved_ones_exactly():
    """The fp32 master partitions after the load against those saved, exactly in every precision (they are
    fp32 whatever the model's dtype); a record without them (stage 0) is not judged on them."""
    rec, oracle = _record(fp32_exact=False)
    rec.update(master={"fp32 master group 0": torch.tensor([1.0, 2.0, 0.5])})
    rec["master_after"] = {k: v.clone() for k, v in rec["master"].items()}
    assert compare_save_load(rec, oracle, (ATOL, RTOL)) is None
    rec["master_after"] = _nudged(rec["master"], "fp32 master group 0")
    got = compare_save_load(rec, oracle, (ATOL, RTOL))
    assert got is not None and got[0] == "master-weights" and "fp32 master group 0" in got[1], got


def test_compare_save_load_zero_to_fp32_is_exact_only_in_fp32():
    """bf16 / fp16: zero_to_fp32 rebuilds the fp32 master copies, which differ from the 16-bit parameters by
    rounding: compared with the oracle at its tolerance, not exactly with the parameters."""
    rec, oracle = _record()
    rec.update(fp32=_nudged(rec["fp32"]), fp32_exact=False)
    assert compare_save_load(rec, oracle, (ATOL, RTOL)) is None
    rec["fp32_exact"] = True
    assert compare_save_load(rec, oracle, (ATOL, RTOL))[0] == "zero-to-fp32"


def test_compare_save_load_leaves_a_divergence_to_the_oracle():
    """When training already disagrees with the oracle (``expected`` None: the oracle finding reports it), a
    faithful checkpoint of the diverged engine passes; with the oracle it would be a second finding."""
    rec, oracle = _record()
    far = {k: v + 1.0 for k, v in oracle.items()}
    assert compare_save_load(rec, far, (ATOL, RTOL))[0] == "16-bit-state-dict"
    assert compare_save_load(rec, None, (ATOL, RTOL)) is None
    rec["state16"] = _nudged(rec["state16"])  # the checkpoint against the engine itself is still checked
    assert compare_save_load(rec, None, (ATOL, RTOL))[0] == "16-bit-state-dict"
