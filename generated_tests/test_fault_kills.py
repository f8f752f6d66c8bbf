"""Checks added for faults of the catalogue (benchmarks/faults/) that survived the default exploration, each
shown to see its fault on a faulted copy of the installed release, run through ``--deepspeed-path`` as the
fault benchmark does; the unfaulted release passes the same scenarios.

* The checkpoint round trip loaded into the engine that had just saved: its master weights already were
  the saved ones.  `checkpoint.round_trip` now moves them before the load (a resume loads into an engine
  whose master weights differ), and the ``checkpoint`` check compares them with the saved ones exactly.
* A recompute that released persistent parameters was seen only by model-agreement, which judges only the
  scenarios the model represents; the ``persistent-resident`` spec judges every ZeRO-3 run.
* A threshold that marks other parameters persistent changes every all-gather and release after it, but no
  spec sees an order it forbids: the ``persistence`` check compares the engine's persistent set with the
  configured threshold on every ZeRO-3 run.
* No example filled a ZeRO-3 bucket exactly, so a gradient that fills it to its size was never left out of the
  contiguous buffer: the completion pairs ZeRO-3's contiguous-buffer route with a bucket of exactly one weight.
* A ``BF16_Optimizer`` step without its clipping stayed inside the bf16 tolerance against an fp32 oracle; the
  mixed-precision oracle's fp32 master weights (`oracle_judgement.step_difference`, kind ``master``) see it.
* A miscounted backward phase changed nothing downstream while the post-backward callback decides the epilogue:
  ``count-matches-hooks`` compares the count and the expectation with the hooks that fire in the task.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from faults.apply import applied, make_tree
from faults.catalogue import by_id

from zerostate.findings import oracle_judgement
from zerostate.model.scenario import Scenario

def _tree(tmp_path: Path) -> Path:
    """A copy of the installed release, laid out as ``--deepspeed-path`` takes it (faults are applied to it)."""
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin
    return make_tree(Path(spec.origin).parent, tmp_path / "tree")


def _outcome_on(tree: Path, sc: Scenario) -> Any:
    """``sc``'s outcome in a fresh worker, which imports the tree as it is now."""
    from zerostate.targets.interface import get_target
    target = get_target("deepspeed", deepspeed_path=str(tree))
    try:
        return target.run(sc)
    finally:
        target.close()


def _findings_on(tree: Path, sc: Scenario) -> list:
    return _outcome_on(tree, sc).findings


TWO = [{}, {"save_load": True}]
CASES = {
    # ZeRO-3 load keeps the engine's fp32 partitions: the 16-bit parameters are rebuilt from them
    "z3-load-skips-fp32-restore": ({"stage": 3, "steps": TWO}, {"checkpoint:round-trip", "checkpoint:master-weights"}),
    # ZeRO-1/2 load rebuilds the fp32 master weights from the 16-bit copies: bf16 rounds them
    "z12-load-from-bit16": ({"stage": 2, "precision": "bf16", "steps": TWO}, {"checkpoint:master-weights"}),
}


@pytest.mark.deepspeed
@pytest.mark.parametrize("fault_id", sorted(CASES))
def test_the_checkpoint_check_kills_a_load_that_keeps_other_master_weights(fault_id, tmp_path):
    tree = _tree(tmp_path)
    scenario, keys = CASES[fault_id]
    with applied(by_id()[fault_id], tree):
        found = _findings_on(tree, Scenario.from_dict(scenario))
    got = {f.violation for f in found}
    assert got & keys, [(f.key, f.error[:300]) for f in found]


@pytest.mark.deepspeed
def test_persistent_resident_kills_a_recompute_that_releases_persistent_parameters(tmp_path):
    """Fault ``release-persistent-recompute`` (a recompute owner's persistent frozen parameters released with
    it) survived the default exploration: model-agreement, which sees it, judges only scenarios the model
    represents.  The ``persistent-resident`` spec judges every ZeRO-3 run: here one with bf16, clipping and
    offload (beyond the model), on the faulted copy and on the release."""
    tree = _tree(tmp_path)
    sc = Scenario.from_dict({"stage": 3, "persistence_threshold": 100000, "precision": "bf16",
                             "gradient_clipping": 1.0, "offload": "both",
                             "blocks": [{"checkpoint": "reentrant", "norm": "frozen"}, {}], "steps": [{}, {}, {}]})
    assert sc.beyond_model()
    with applied(by_id()["release-persistent-recompute"], tree):
        keys = {True: {f.violation for f in _findings_on(tree, sc)}}
    keys[False] = {f.violation for f in _findings_on(tree, sc)}
    assert "persistent-resident:persistent-released" in keys[True], keys
    assert not keys[False], keys


@pytest.mark.deepspeed
def test_the_persistence_check_kills_a_threshold_that_excludes_its_boundary(tmp_path):
    """Fault ``persistence-threshold-strict`` (``<`` for ``<=``: a parameter of exactly the threshold's size is
    partitioned) changes only which parameters stay gathered.  At threshold 8 and width 8 every bias and norm
    weight is at the boundary: the faulted copy leaves them partitioned, the release keeps them persistent."""
    tree = _tree(tmp_path)
    sc = Scenario.from_dict({"stage": 3, "persistence_threshold": 8, "width": 8, "precision": "bf16",
                             "blocks": [{}, {"checkpoint": "reentrant"}], "steps": [{}, {}]})
    with applied(by_id()["persistence-threshold-strict"], tree):
        faulted = _findings_on(tree, sc)
    clean = _findings_on(tree, sc)
    (found,) = [f for f in faulted if f.check == "persistence"]
    assert found.key == "persistence:threshold-not-honoured"
    assert "blocks.0.lin.bias (8 elements) is not persistent" in found.error, found.error
    assert not clean, [(f.key, f.error[:300]) for f in clean]


@pytest.mark.deepspeed
def test_the_master_weights_check_kills_a_bf16_step_that_skips_its_clipping(tmp_path):
    """Fault ``bf16-clip-threshold`` (``BF16_Optimizer`` clips only above 1.0) was reached by the default
    exploration and survived: against an fp32 oracle, bf16's per-element tolerance and the update's norm hide
    it.  The mixed-precision oracle's master weights start where DeepSpeed's do and take the same bf16
    gradients, so the ``master`` comparison sees the unclipped step; the release passes the same scenario."""
    tree = _tree(tmp_path)
    sc = Scenario.from_dict({"stage": 1, "precision": "bf16", "fp32_grad_accum": True, "gradient_clipping": 0.05,
                             "steps": [{}, {}]})
    with applied(by_id()["bf16-clip-threshold"], tree):
        faulted = _findings_on(tree, sc)
    clean = _findings_on(tree, sc)
    seen = [f for f in faulted if f.check == "oracle" and f.evidence.oracle is not None
            and f.evidence.oracle.kind == "master"]
    assert seen, [(f.key, f.error[:300]) for f in faulted]
    assert all("the fp32 master weight of" in f.error and not f.known for f in seen), \
        [(f.key, f.known, f.error[:300]) for f in seen]
    assert not clean, [(f.key, f.error[:300]) for f in clean]


@pytest.mark.deepspeed
def test_an_exactly_filled_zero3_bucket_sees_a_gradient_left_out_of_the_contiguous_buffer(tmp_path):
    """Fault ``z3-contiguous-exact-fit`` (``<`` for ``<=``: a gradient that fills the bucket exactly is not copied
    into its contiguous buffer) survived: no example's bucket was filled exactly.  With ``reduce_scatter`` off
    ZeRO-3 reduces that buffer; a bucket of one Linear weight (width 8: 64 elements, the completion's pair
    ``reduce_bucket=one weight x z3_reduce=contiguous buffer``) reduces whatever the buffer held instead of
    the weight's gradient, and the oracle sees it; the release passes the same scenario."""
    tree = _tree(tmp_path)
    sc = Scenario.from_dict({"stage": 3, "reduce_scatter": False, "reduce_bucket_size": 64, "width": 8,
                             "steps": [{"save_load": True}]})
    with applied(by_id()["z3-contiguous-exact-fit"], tree):
        faulted = _findings_on(tree, sc)
    clean = _findings_on(tree, sc)
    assert any(f.key.startswith("oracle:") and "lin.weight" in f.error for f in faulted), \
        [(f.key, f.error[:300]) for f in faulted]
    assert not clean, [(f.key, f.error[:300]) for f in clean]


COUNT_CASES = {
    # the count takes every seen gradient node, executed or not: ZeRO-1 with a norm in no loss path
    "count-all-grad-nodes": ({"stage": 1, "blocks": [{"norm": "unused"}]}, "count-matches-hooks:count-not-hooks"),
    # ZeRO-3 leaves the z3 leaf modules out of the expected count; the leaf's hook fires in the counted task
    "z3-count-misses-leaf-modules": ({"stage": 3, "blocks": [{"leaf": True}, {}]},
                                     "count-matches-hooks:expected-short"),
}


@pytest.mark.deepspeed
@pytest.mark.parametrize("fault_id", sorted(COUNT_CASES))
def test_count_matches_hooks_kills_a_miscounted_phase(fault_id, tmp_path):
    """Faults ``count-all-grad-nodes`` and ``z3-count-misses-leaf-modules`` survived: with the post-backward
    callback queued the expected count decides no epilogue, so nothing downstream changed.  The tracer records
    what count_used_parameters_in_backward returned (COUNT) and the count DeepSpeed's hook state is handed
    (EXPECTED), and ``count-matches-hooks`` compares both with the hooks that fire in that graph task."""
    tree = _tree(tmp_path)
    sc_dict, key = COUNT_CASES[fault_id]
    sc = Scenario.from_dict(sc_dict)
    with applied(by_id()[fault_id], tree):
        faulted = _findings_on(tree, sc)
    clean = _findings_on(tree, sc)
    assert key in {f.violation for f in faulted}, [(f.key, f.error[:300]) for f in faulted]
    assert all(f.key.startswith(f"{f.violation}@") for f in faulted if f.violation == key), \
        [f.key for f in faulted]
    assert not clean, [(f.key, f.error[:300]) for f in clean]


@pytest.mark.deepspeed
def test_the_loss_scale_after_the_last_step_kills_a_scaler_that_grows_on_overflow(tmp_path):
    """Fault ``loss-scale-grows-on-overflow`` (the dynamic scale doubles after an overflow instead of halving)
    skips the same steps as the release when only the last step overflows, so the skipped-step count cannot
    see it.  The oracle runs DeepSpeed's scaler policy, so the scale the next step would run with is compared
    too: one fp16 step at scale 2**24 overflows on both trees; the release halves the scale as the oracle
    does, the faulted copy doubles it.  Three clean steps at 2**8 double the scale once (window 2) on both.

    On the release the oracle also sees, on the step where the scale grows, the known ZeRO bug
    ``fp16-scale-increase-halves-step`` (the gradients are unscaled by the new scale, so that update is half):
    a difference of the step's update, explained by its mechanism alone -- never of the loss scale."""
    tree = _tree(tmp_path)
    overflow = Scenario.from_dict({"stage": 2, "precision": "fp16", "loss_scale_power": 24, "steps": [{}]})
    grows = Scenario.from_dict({"stage": 2, "precision": "fp16", "steps": [{}, {}, {}]})
    with applied(by_id()["loss-scale-grows-on-overflow"], tree):
        faulted = _findings_on(tree, overflow)
    doubled = _outcome_on(tree, grows)
    clean = _findings_on(tree, overflow)
    (found,) = [f for f in faulted if f.check == "oracle"]
    assert found.evidence.oracle is not None and found.evidence.oracle.kind == "loss-scaling", found.evidence
    grown, halved = 2.0 ** 25, 2.0 ** 23
    assert f"loss scale after the last step is {grown:g}, PyTorch's loss scaler's {halved:g}" in found.error, \
        found.error
    assert not clean, [(f.key, f.error[:300]) for f in clean]
    fp16 = doubled.record.loss_scaling
    assert fp16.ds_skipped == 0 and fp16.ds_scale == fp16.pt_scale == 2.0 ** 9, fp16
    judged = oracle_judgement.verdict(doubled.record, grows)
    kinds = {d.kind for d in judged.differences} if judged else set()
    assert "loss-scaling" not in kinds, kinds
    known = [(f.check, f.known, f.evidence.explained_by) for f in doubled.findings]
    assert set(known) <= {("oracle", "fp16-scale-increase-halves-step", ("update-halved-when-scale-grows",))}, \
        [(f.key, f.known, f.error[:300]) for f in doubled.findings]
    explained = oracle_judgement.explaining(doubled.record, grows)
    assert not doubled.findings or (explained is not None and explained.remaining == ()), explained
