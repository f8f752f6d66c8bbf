"""The seed bugs the project started from (/work/shared/seeds: seed 000 parts 1 and 2, seed 002), as known
issues of the releases that have them; part of the one table (`known.issues`).

Seed 000 part 1 is fixed by DeepSpeed PR #7780 (0.18.5); that fix's per-hook count is part 2, reported as
#7882 / #7885 and fixed by #7886 (0.18.7).  Seed 002 is DeepSpeed #4332's mechanism (reported on releases
long before 0.18.4) and is fixed in 0.19.3.  On which releases each range was established:
docs/known-issues-provenance.md."""

from __future__ import annotations

from zerostate.model.scenario import Scenario

from zerostate.findings.finding import Finding
from zerostate.known import rules
from zerostate.known.issue import KnownIssue
from zerostate.known.mechanism import narrow


def is_seed_000_part1(f: Finding) -> bool:
    """The premature epilogue of a reentrant-checkpointed PyTorch-style backward under ZeRO-3: a hook after the
    epilogue in its trace, and the exception at the next step (CPU: RuntimeError 'unknown parameter type' from
    zero_grad) or the spec violations it comes with."""
    return rules.premature_epilogue(f) and narrow(f, lambda sc: sc.stage == 3 and any(
        b.checkpoint.value == "reentrant" for b in sc.blocks) and any(
        m.backward.pytorch_style for _, _, m in sc.micro_steps()))


def is_seed_000_part2(f: Finding) -> bool:
    """count_used_parameters_in_backward evaluated again in one graph task (every hook)."""
    return rules.counted_in_every_hook(f)


def is_seed_002(f: Finding) -> bool:
    """A frozen parameter the non-reentrant recompute saved live, partitioned before torch's check."""
    return rules.frozen_partitioned_in_recompute(f) and narrow(f, lambda sc: sc.stage == 3)


SEED_000_PART1 = KnownIssue(
    id="seed-000-part-1",
    title="ZeRO-3: premature epilogue of a reentrant-checkpointed PyTorch-style backward (DeepSpeed #7780)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 18, 5)),
    fixed_in="0.18.5",
    scenario=Scenario.from_dict({"blocks": [{"checkpoint": "reentrant"}, {}], "stage": 3,
                                 "steps": [{"micro": [{"backward": "torch"}]},
                                           {"micro": [{"backward": "nonscalar"}]}]}),
    # what its scenario shows on 0.18.4 (its recorded fingerprints); not a clean-step violation, so that is not
    # claimed: such a finding reads unexplained until a repro shows it
    checks=("exception", "epilogue-once", "grad-handled-once"),
    explains=is_seed_000_part1,
    runtime_prevents=True,
    detail=("0.18.4's remaining-hooks counter reaches 0 at the end of the first autograd phase of a reentrant "
            "checkpoint's backward; the epilogue reduces and clears too early, and stale parameters stay in the "
            "ipg buckets: the next step fails (CPU: RuntimeError 'unknown parameter type' from zero_grad's "
            "record_stream; GPU: AttributeError 'NoneType' object has no attribute 'numel').  Fixed in 0.18.5 by "
            "DeepSpeed PR #7780 (dynamic hook count for reentrant checkpointing).  The zerostate runtime's hook "
            "state prevents it."),
)

SEED_000_PART2 = KnownIssue(
    id="seed-000-part-2",
    title="count_used_parameters_in_backward counted in every gradient hook, not once per backward phase",
    owner="deepspeed",
    releases=((0, 18, 5), (0, 18, 7)),
    fixed_in="0.18.7",
    scenario=Scenario.from_dict({"blocks": [{}, {}], "stage": 2, "steps": [{"micro": [{"backward": "engine"}]}]}),
    checks=("count-once-per-phase",),
    explains=is_seed_000_part2,
    runtime_prevents=True,
    detail=("0.18.5 and 0.18.6 re-count the parameters used by the backward in every hook (PR #7780 put the call "
            "inside every gradient hook closure): quadratic in the number of parameters.  Reported as "
            "deepspeedai/DeepSpeed#7882 and #7885, fixed by #7886 (0.18.7): once per phase."),
)

SEED_002 = KnownIssue(
    id="seed-002",
    title="ZeRO-3: a frozen parameter partitioned during a non-reentrant recompute (CheckpointError)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 3)),
    fixed_in="0.19.3",
    scenario=Scenario.from_dict({"blocks": [{"checkpoint": "non_reentrant", "norm": "frozen"}], "stage": 3,
                                 "steps": [{"micro": [{"backward": "engine"}]}]}),
    checks=("saved-tensor-intact",),
    explains=is_seed_002,
    runtime_prevents=True,
    detail=("torch.utils.checkpoint keeps a frozen tensor saved by the recompute as itself (x.detach() only if "
            "x.requires_grad), and ZeRO-3 partitions parameters in place (param.data = empty(0)); releases before "
            "0.19.3 release a frozen parameter fetched by the recompute at its post-forward, before torch checks "
            "the recomputed tensors' metadata: CheckpointError (recomputed shape [0]).  Fixed in 0.19.3 "
            "(deepspeedai/DeepSpeed#8130, #8148).  The zerostate runtime's release policy keeps such parameters "
            "until their backward (docs/runtime.md)."),
)

SEED_ISSUES: tuple[KnownIssue, ...] = (SEED_000_PART1, SEED_000_PART2, SEED_002)

__all__ = ["SEED_000_PART1", "SEED_000_PART2", "SEED_002", "SEED_ISSUES", "is_seed_000_part1", "is_seed_000_part2",
           "is_seed_002"]
