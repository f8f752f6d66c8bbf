"""What ZeRO-1/2's offloaded fp32 gradient partition carries from one step into the next, and the search that names a
finding's sum of mechanisms.

With ``offload_optimizer`` the backward copies each gradient into a CPU fp32 partition that nothing clears between
steps; a parameter no copy reaches in a step (frozen for it, or every gradient of it lost to another bug) is stepped
with what its slot still holds.  Each test runs real DeepSpeed (the pinned release) on a scenario of its own and
asserts the counterfactual that explains the oracle's finding and the known issue it is labelled with; the fast
ones check the judgement's NaN agreement and the search's alternatives.
"""

from __future__ import annotations

import math

import pytest
import torch

from zerostate.harness.executor import _combinable
from zerostate.harness.observe import param_steps
from zerostate.known.issues import explain_all
from zerostate.model.scenario import Scenario


def _oracle(ds, sc: Scenario) -> list:
    if ds.version != "0.19.8":
        pytest.skip("measured on 0.19.8")
    found = [f for f in ds.run(sc).findings if f.check == "oracle"]
    assert found, "no oracle finding"
    return found


def _explained(found: list) -> set[frozenset[str]]:
    return {frozenset(f.evidence.explained_by or ()) for f in found}


def _labels(found: list) -> set[frozenset[str]]:
    return {frozenset(k.id for k in explain_all(f)) for f in found}


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_offload_a_weight_frozen_after_an_overflow_becomes_nan(ds, stage):
    """Step 0 overflows at the initial scale 2**16 and is skipped, as PyTorch's scaler skips it; step 1 freezes
    block 0's Linear.  Its slot still holds step 0's non-finite gradient, no overflow check looks at it, and
    DeepSpeed steps it: the fp32 master weight is NaN where PyTorch's is unmoved."""
    sc = Scenario.from_dict({"stage": stage, "precision": "fp16", "loss_scale_power": 16, "offload": "optimizer",
                             "steps": [{}, {"frozen": [0]}]})
    found = _oracle(ds, sc)
    assert _explained(found) == {frozenset({"overflowed-gradient-replayed"})}, [f.error[:200] for f in found]
    assert _labels(found) == {frozenset({"fp16-offload-overflowed-grad-after-freeze"})}
    assert all("= nan against" in f.error for f in found), [f.error[:200] for f in found]


@pytest.mark.deepspeed
def test_fp16_offload_a_weight_frozen_after_a_clean_step_is_unscaled_again(ds):
    """No overflow: the frozen slot holds the step before's gradient, already unscaled, and ZeRO-1 unscales the whole
    partition in place again -- the frozen Linear moves by that gradient over the loss scale (PyTorch: not at all),
    which only the unscaled-again form of offload-stale-grad-after-freeze explains."""
    sc = Scenario.from_dict({"stage": 1, "precision": "fp16", "offload": "optimizer", "blocks": [{}, {}, {}],
                             "width": 7, "steps": [{}, {"frozen": [2]}]})
    found = _oracle(ds, sc)
    assert _explained(found) == {frozenset({"stale-gradient-unscaled-again-when-frozen"})}, \
        [f.error[:200] for f in found]
    assert _labels(found) == {frozenset({"offload-stale-grad-after-freeze"})}


@pytest.mark.deepspeed
@pytest.mark.parametrize("precision, explained", [
    ("fp32", {"in-forward-lost-in-step-of-unexited-backward"}),
    ("fp16", {"in-forward-lost-in-step-of-unexited-backward", "overflowed-gradient-replayed"}),
])
def test_zero2_offload_caller_boundary_loses_the_heads_gradient_after_an_unexited_backward(ds, precision, explained):
    """ZeRO-2 with offload, a fused head and a caller-owned boundary: in the step whose micro-step 0 has a
    never-exited PyTorch-style second backward, every in-forward gradient (the head's) is lost and the head is
    stepped with its slot's previous gradient (measured per parameter); at fp16 that slot holds step 0's overflowed
    one, so the head becomes NaN -- a sum of two mechanisms."""
    extra = {"precision": "fp16", "loss_scale_power": 16} if precision == "fp16" else {}
    sc = Scenario.from_dict({"stage": 2, "fused_head": True, "offload": "optimizer", "manual_boundary": True,
                             "blocks": [{}], **extra, "steps": [
                                 {"micro": [{"backward": "engine"}, {"backward": "engine"}]},
                                 {"micro": [{"backward": "torch", "retain": True}, {"backward": "engine"}]}]})
    found = _oracle(ds, sc)
    assert _explained(found) == {frozenset(explained)}, [f.error[:200] for f in found]
    labels = {"two-backwards-per-forward"} | ({"fp16-offload-overflowed-grad-after-freeze"} if extra else set())
    assert _labels(found) == {frozenset(labels)}


@pytest.mark.deepspeed
@pytest.mark.parametrize("steps, explained", [
    ([{"micro": [{"backward": "torch", "retain": True}]}, {"micro": [{"backward": "torch"}]}],
     {"last-backward-only", "step-lost-after-unexited-backward"}),
    ([{"micro": [{"backward": "torch", "retain": True}, {"backward": "torch", "retain": True}]},
      {"micro": [{"backward": "engine"}, {"backward": "torch"}]}],
     {"step-lost-after-unexited-backward"}),
], ids=["boundary-then-plain", "before-boundary-then-engine-first"])
def test_zero1_offload_steps_after_an_unexited_backward_are_lost(ds, steps, explained):
    """ZeRO-1 with offload: once a PyTorch-style second backward never exits DeepSpeed's backward, a later step whose
    boundary has PyTorch-style backwards only copies nothing into the partition and replays what it held (measured
    per parameter: the step before's applied gradient), not only the step of that backward."""
    sc = Scenario.from_dict({"stage": 1, "offload": "optimizer", "blocks": [{}], "steps": steps})
    found = _oracle(ds, sc)
    assert _explained(found) == {frozenset(explained)}, [f.error[:200] for f in found]
    assert _labels(found) == {frozenset({"two-backwards-per-forward"})}


@pytest.mark.deepspeed
def test_zero2_fused_head_two_backwards_keep_the_last_alone(ds):
    """ZeRO-2 with a fused head and two engine backwards of one forward: as at ZeRO-1, the head's in-forward gradient
    is lost with the first backward (the next, single-backward step is right)."""
    sc = Scenario.from_dict({"stage": 2, "fused_head": True, "blocks": [{}],
                             "steps": [{"micro": [{"backward": "engine", "retain": True}]}, {}]})
    found = _oracle(ds, sc)
    assert _explained(found) == {frozenset({"last-backward-only-in-forward-too"})}, [f.error[:200] for f in found]


def test_a_weight_both_sides_make_nan_agrees_and_nan_against_a_number_differs():
    """The judgement's NaN agreement: a counterfactual that makes a weight NaN where DeepSpeed does matches it; NaN
    (or an infinity) against a number never passes, nor an infinity against the other."""
    start = {"w": torch.zeros(3)}
    nan = {"w": torch.tensor([float("nan"), 1.0, 2.0])}
    same = param_steps(nan, {"w": nan["w"].clone()}, start, start)[0]
    assert same.update_err_max == 0.0 and same.err_max == 0.0 and math.isfinite(same.update_max)
    for want in (torch.tensor([0.5, 1.0, 2.0]), torch.tensor([float("inf"), 1.0, 2.0])):
        got = param_steps({"w": want}, nan, start, start)[0]
        assert math.isnan(got.update_err_max), want
    inf = param_steps({"w": torch.tensor([float("inf")])}, {"w": torch.tensor([float("-inf")])},
                      {"w": torch.zeros(1)}, {"w": torch.zeros(1)})[0]
    assert not inf.update_err_max <= 1e30


def test_a_sum_never_combines_two_alternative_rules():
    """Two rules for one piece of DeepSpeed (which boundary backward it keeps; which outputs divide by gas) are never
    tried together; rules for different pieces are."""
    assert not _combinable(("last-backward-only", "boundary-first-backward-lost"))
    assert not _combinable(("output-hooks-divide-by-gas", "output-hooks-divide-by-gas-engine-backward"))
    assert _combinable(("unexited-backward-lost-before-boundary", "boundary-first-backward-lost",
                        "output-hooks-divide-by-gas"))


@pytest.mark.deepspeed
def test_zero1_fp32_accumulation_offload_keeps_both_backwards_after_an_unexited_one(ds):
    """ZeRO-1's optimizer with the fp32 ``grad_accum`` attribute (bf16, fp32 accumulation, offload): step 0's
    retained PyTorch-style backward keeps the last backward alone, as everywhere; in the step after it, never exited,
    both engine backwards of one forward reach the step (measured per parameter: 2.0 x one backward)."""
    sc = Scenario.from_dict({"stage": 1, "offload": "optimizer", "precision": "bf16", "fp32_grad_accum": True,
                             "blocks": [{}], "steps": [{"micro": [{"backward": "torch", "retain": True}]},
                                                       {"micro": [{"backward": "engine", "retain": True}]}]})
    found = _oracle(ds, sc)
    assert _explained(found) == {frozenset({"last-backward-only-until-unexited-backward"})}, \
        [f.error[:200] for f in found]


def _without_retains(sc: Scenario) -> Scenario:
    d = sc.to_dict()
    for step in d["steps"]:
        for m in step["micro"]:
            m.pop("retain", None)
    return Scenario.from_dict(d)


@pytest.mark.deepspeed
@pytest.mark.parametrize("issue_id, variant", [
    ("two-backwards-per-forward", 53), ("two-backwards-per-forward", 54), ("two-backwards-per-forward", 55),
    ("two-backwards-per-forward", 56), ("two-backwards-per-forward", 57), ("two-backwards-per-forward", 58),
    ("two-backwards-per-forward", 59), ("two-backwards-per-forward", 60), ("two-backwards-per-forward", 61),
    ("zero12-backward-without-gradients", 4), ("zero12-backward-without-gradients", 5),
    ("zero12-backward-without-gradients", 6),
    ("empty-param-group-dropped-under-scheduler", 4), ("z3-leaf-kept-gathered", 1)])
def test_a_fresh_sequences_spec_and_exception_forms_carry_their_issues_label(ds, issue_id, variant):
    """The forms the fresh sequences of seeds 11, 13 and 17 met unlabelled, each a variant of its issue: its findings
    with the issue's recorded fingerprints carry that label; a form with a second backward gives none of them
    without its retains."""
    from zerostate.known.issues import by_id, explain
    if ds.version != "0.19.8":
        pytest.skip("recorded on 0.19.8")
    k = by_id(issue_id)
    assert k is not None
    sc = k.variants[variant - 1]
    own = [f for f in ds.run(sc).findings if f.key in k.fingerprints]
    assert own, f"{issue_id} variant {variant}: none of its recorded fingerprints"
    assert all(explain(f) is k for f in own), [(f.key, explain(f)) for f in own]
    if any(m.retain for _, _, m in sc.micro_steps()):
        again = [f.key for f in ds.run(_without_retains(sc)).findings if f.key in {g.key for g in own}]
        assert not again, again


@pytest.mark.deepspeed
@pytest.mark.parametrize("boundary", [
    [{"backward": "nonscalar", "retain": True}], [{"backward": "torch"}]], ids=["retained-nonscalar", "torch"])
def test_zero2_fp32_accumulation_loses_pytorch_style_backwards_after_an_unexited_one(ds, boundary):
    """ZeRO-2 with bf16 and fp32 gradient accumulation (no offload): after a never-exited PyTorch-style second
    backward before the boundary, that backward's share and every PyTorch-style backward of the boundary micro-step
    are lost (measured per contribution on the first form; the second, a form the rule was not built on, matches)."""
    first = ([{"backward": "engine", "retain": True}, {"backward": "nonscalar", "retain": True}]
             if boundary[0].get("retain") else [{"backward": "torch", "retain": True}])
    sc = Scenario.from_dict({"stage": 2, "precision": "bf16", "fp32_grad_accum": True, "blocks": [{}],
                             "steps": [{"micro": [*first, *boundary]}]})
    found = _oracle(ds, sc)
    assert _explained(found) == {frozenset({"pytorch-style-backwards-lost-after-unexited-backward"})}, \
        [f.error[:200] for f in found]
    assert _labels(found) == {frozenset({"two-backwards-per-forward"})}


@pytest.mark.deepspeed
def test_zero3_fp16_parameter_and_optimizer_offload_idle_step_replays_over_the_scale(ds):
    """Parameter offload beside optimizer offload (``offload: both``) leaves the ZeRO-3 idle step's replay over the
    loss scale as optimizer offload alone does."""
    sc = Scenario.from_dict({"stage": 3, "precision": "fp16", "offload": "both", "blocks": [{}],
                             "steps": [{}, {"idle": True}]})
    found = _oracle(ds, sc)
    assert _explained(found) == {frozenset({"stale-gradient-unscaled-again-at-idle-step"})}, \
        [f.error[:200] for f in found]
