"""`zero1-reduce-keeps-other-partitions` (issue 42): ZeRO-1 with fp32 gradient accumulation (bf16 + optimizer
offload) at world size 2 keeps each rank's gradient of the parameters outside its partition after a reduction,
so a second backward of one forward in the boundary micro-step reduces it again.

* no DeepSpeed: the counterfactual's arithmetic (`counterfactual.reduced_again`, `zero1_owners`): a non-owning
  rank's share is sent 0.625 times instead of 0.5 times for two halves of the loss; an owner's once;
* real DeepSpeed at world size 2 (the release ``--deepspeed`` / ``--deepspeed-path`` names, else the installed
  one): on a release the issue affects, the shrunk scenario's oracle finding carries the label, explained by the
  counterfactual on every rank; the same scenario without the second backward, and at ZeRO-2, are clean.  On a
  release without it (a tree with docs/upstream/zero1-reduce-keeps-other-partitions/fix.patch) the shrunk scenario
  is clean too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerostate.harness.net.counterfactual import MECHANISMS, Contribution, reduced_again, zero1_owners
from zerostate.known.issues import by_id, explain
from zerostate.model.scenario import Scenario

ISSUE = "zero1-reduce-keeps-other-partitions"
MECHANISM = "zero1-outside-partition-reduced-again"
SCENARIO = Path(__file__).resolve().parent.parent / "docs" / "upstream" / ISSUE / "scenario.json"


def _shrunk() -> Scenario:
    return Scenario.from_dict(json.loads(SCENARIO.read_text()))


# ---------------------------------------------------------------- the counterfactual's arithmetic (no DeepSpeed)
def test_the_issue_names_the_mechanism_and_its_upstream_folder():
    k = by_id(ISSUE)
    assert k is not None and k.mechanisms == (MECHANISM,) and k.checks == ("oracle", "crash") and k.world_size == 2
    assert k.upstream_patch == f"docs/upstream/{ISSUE}/"
    assert k.scenario.with_(world_size=2) == _shrunk()  # the record runs at world size 1 too (and is clean there)
    assert MECHANISMS[MECHANISM].applies(_shrunk())
    for change in ({"stage": 2}, {"world_size": 1}, {"offload": "none"}, {"fp32_grad_accum": False},
                   {"steps": [{"micro": [{"backward": "engine"}]}]}):
        assert not MECHANISMS[MECHANISM].applies(Scenario.from_dict({**json.loads(SCENARIO.read_text()), **change}))


def test_owners_follow_zero1s_flat_partitions():
    """One block (LayerNorm 8 + 8, Linear 64 + 8: 88 elements, two partitions of 44): the norm in rank 0's,
    the Linear's weight across both, its bias in rank 1's; padding to a multiple of 2 x world size."""
    group = [("norm.weight", 8), ("norm.bias", 8), ("lin.weight", 64), ("lin.bias", 8)]
    assert zero1_owners([group], 2) == {"norm.weight": frozenset({0}), "norm.bias": frozenset({0}),
                                        "lin.weight": frozenset({0, 1}), "lin.bias": frozenset({1})}
    assert zero1_owners([[("a", 3), ("b", 2)]], 2) == {"a": frozenset({0}), "b": frozenset({0, 1})}  # 5 -> 8


def _backward(index: int, shares: list[float]) -> Contribution:
    ranks = tuple({"p": torch.tensor([s])} for s in shares)
    return Contribution("backward", 0, index, {"p": torch.tensor([sum(shares)])}, ranks)


@pytest.mark.parametrize("all_reduce", [False, True])
def test_a_non_owner_sends_its_first_share_again(all_reduce):
    """Two halves of the loss, rank 0's gradient 4 and rank 1's 2 (shares over world size 2: 1 and 0.5 per half),
    the parameter in rank 0's partition.  Reduce-scatter: rank 1 kept its divided first share (0.5) and sends
    half of it again: 0.25 more, its share 0.625 of its gradient instead of 0.5.  All-reduce: it kept the reduced
    value (1.5) and sends half of that again."""
    cs = [_backward(0, [1.0, 0.5]), _backward(1, [1.0, 0.5])]
    extra = reduced_again(cs, 1, {"p": frozenset({0})}, 2, all_reduce)
    assert extra is not None
    assert float(extra["p"]) == (0.75 if all_reduce else 0.25)
    if not all_reduce:
        assert (0.5 + 0.5 + float(extra["p"])) / 2 == 0.625  # rank 1's share of its gradient 2
    assert reduced_again(cs, 1, {"p": frozenset({0, 1})}, 2, all_reduce) is None  # held by both: cleared on both
    assert reduced_again(cs[:1], 1, {"p": frozenset({0})}, 2, all_reduce) is None  # one backward: one reduction


def test_the_second_backward_of_an_earlier_micro_step_is_not_reduced_twice():
    """Only the boundary micro-step reduces per backward; an earlier micro-step's two backwards accumulate."""
    first = Contribution("backward", 0, 0, {"p": torch.tensor([1.5])}, ({"p": torch.tensor([1.0])},
                                                                      {"p": torch.tensor([0.5])}))
    second = Contribution("backward", 0, 1, first.grads, first.ranks)
    last = Contribution("backward", 1, 0, first.grads, first.ranks)
    assert reduced_again([first, second, last], 2, {"p": frozenset({0})}, 2, False) is None


# ---------------------------------------------------------------- real DeepSpeed at world size 2
@pytest.fixture(scope="module")
def ds2(request):
    from zerostate.targets.interface import get_target
    opts = {"deepspeed": request.config.getoption("--deepspeed"),
            "deepspeed_path": request.config.getoption("--deepspeed-path")}
    t = get_target("deepspeed", world_size=2, **{k: v for k, v in opts.items() if v})
    yield t
    t.close()


def _fmt(findings) -> str:
    return "\n".join(f"{f.key}: {(f.error or '')[:300]}" for f in findings)


@pytest.mark.deepspeed
@pytest.mark.slow
def test_the_shrunk_scenario_is_the_issue_explained_by_its_counterfactual(ds2):
    from zerostate.findings.oracle_judgement import explaining
    from zerostate.harness.cross_rank_checks import rank_runs
    issue = by_id(ISSUE)
    sc = _shrunk()
    out = ds2.run(sc)
    if not issue.affects(ds2.version) or (ds2.path and not out.findings):  # a release without it, a fixed tree
        assert not out.findings, _fmt(out.findings)
        return
    assert [f.check for f in out.findings] == ["oracle"], _fmt(out.findings)
    f = out.findings[0]
    assert f.key == f"oracle:{MECHANISM}@first-step" and f.evidence.explained_by == (MECHANISM,), _fmt([f])
    assert explain(f) is issue
    records = [r.record for r in rank_runs(ds2._last["ranks"])]
    assert len(records) == 2 and all(r is not None for r in records)
    for rec in records:  # each rank's DeepSpeed run matches the counterfactual reference at every step
        ex = explaining(rec, sc)
        assert ex is not None and ex.mechanisms == (MECHANISM,) and not ex.remaining


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("near", ["one backward", "zero-2"])
def test_its_near_misses_are_clean(ds2, near):
    """The same scenario without the second backward of the forward, and at ZeRO-2 (whose branch of
    reduce_ipg_grads clears the other partitions' gradients): no finding at all."""
    d = json.loads(SCENARIO.read_text())
    if near == "one backward":
        d["steps"] = [{"micro": [{"backward": "engine"}]}]
    else:
        d["stage"] = 2
    out = ds2.run(Scenario.from_dict(d))
    assert not out.findings, _fmt(out.findings)


@pytest.mark.deepspeed
@pytest.mark.slow
def test_with_a_fused_head_the_ranks_reduce_buckets_of_different_sizes(ds2):
    """The same route with a fused head (seed 17's unexplained crash): the non-owner's kept gradient changes what
    its bucket holds at the second backward's reduction, gloo sees two sizes for one all-reduce and aborts a rank.
    The crash's identity is what its rank's log shows (``crash:collective-mismatch``), labelled by this issue's
    rule; without the second backward the run is clean.  On a tree with the patch it passes (measured)."""
    issue = by_id(ISSUE)
    sc = issue.variants[0]
    out = ds2.run(sc)
    if not issue.affects(ds2.version) or (ds2.path and not out.findings):
        assert not out.findings, _fmt(out.findings)
        return
    assert [f.key for f in out.findings] == ["crash:collective-mismatch"], _fmt(out.findings)
    assert explain(out.findings[0]) is issue
    d = sc.to_dict()
    d["steps"] = [{"micro": [{"backward": "engine"}]}]
    assert not ds2.run(Scenario.from_dict(d)).findings
