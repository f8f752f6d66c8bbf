"""What explains a violation `zerostate watch` sees on a user's job: the known DeepSpeed issues, by spec.

Each entry names the spec (or ``exception``) it shows as, the releases observed to have it (half-open),
the first release that fixes it (None: not fixed as of the pinned 0.19.8), whether ``zerostate.runtime``
prevents it (docs/runtime.md: the hook state for seed 000, the release policy for seed 002, the leaf
deferral for z3-leaf-input-without-grad, the leaf reuse walk for z3-leaf-kept-gathered), and what in the job must be seen for it
to apply (``needs``: a non-reentrant recompute, a z3 leaf module fed without grad, ...).  The findings on
the pinned release and their scenarios live in `known` (``KNOWN_ISSUES``); the seed bugs in ``SEED_BUGS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from zerostate.tracing import compat
from zerostate.known.issues import (Z3_LEAF_INPUT_NO_GRAD, Z3_LEAF_KEPT_GATHERED, Z3_NO_POST_BACKWARD_NO_DRAIN,
                                    ZERO12_NO_GRADIENT)


@dataclass(frozen=True)
class Explanation:
    id: str
    title: str
    checks: tuple[str, ...]
    releases: tuple[tuple[int, int, int], tuple[int, int, int]]
    fixed_in: str | None
    runtime_prevents: bool
    detail: str
    needs: Callable[[dict], bool] = lambda ctx: True
    """``ctx``: what the watcher saw (``leaf_without_grad``, ``nonreentrant``, ``stage``, ``error``)."""

    def to_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "fixed_in": self.fixed_in,
                "runtime_prevents": self.runtime_prevents, "detail": self.detail}


SEED_002 = Explanation(
    id="seed 002",
    title=("ZeRO-3 partitions a frozen parameter that a non-reentrant checkpoint's recompute saved as a live "
           "reference: torch's CheckpointError (recomputed values have different metadata)"),
    checks=("saved-tensor-intact", "exception"), releases=((0, 19, 0), (0, 19, 3)), fixed_in="0.19.3",
    runtime_prevents=True,
    detail=("torch.utils.checkpoint keeps a frozen tensor saved by the recompute as itself (x.detach() only if "
            "x.requires_grad), and ZeRO-3 partitions parameters in place (param.data = empty(0)); 0.19.0-0.19.2 "
            "release a frozen parameter fetched by the recompute at its post-forward, before torch checks the "
            "recomputed tensors' metadata.  Fixed in 0.19.3 (deepspeedai/DeepSpeed#8130, #8148).  The zerostate "
            "runtime's release policy keeps such parameters until their backward (docs/runtime.md)."),
    needs=lambda ctx: ctx.get("stage") == 3 and (ctx.get("check") != "exception" or "CheckpointError" in ctx.get(
        "error", "") or "different metadata" in ctx.get("error", "")))

SEED_000_PART1 = Explanation(
    id="seed 000 part 1",
    title="The epilogue runs after the first phase of a reentrant-checkpointed PyTorch-style backward",
    checks=("epilogue-once", "grad-handled-once", "clean-step"), releases=((0, 18, 4), (0, 18, 5)),
    fixed_in="0.18.5", runtime_prevents=True,
    detail=("0.18.4's remaining-hooks counter reaches 0 at the end of the first autograd phase of a reentrant "
            "checkpoint's backward; the epilogue reduces and clears too early (deepspeedai/DeepSpeed#7780)."))

SEED_000_PART2 = Explanation(
    id="seed 000 part 2",
    title="count_used_parameters_in_backward evaluated in every gradient hook",
    checks=("count-once-per-phase",), releases=((0, 18, 5), (0, 18, 7)), fixed_in="0.18.7", runtime_prevents=True,
    detail=("0.18.5 and 0.18.6 re-count the parameters used by the backward in every hook: quadratic in the number "
            "of parameters (deepspeedai/DeepSpeed#7882, #7885; fixed by #7886)."))

Z3_LEAF_INPUT = Explanation(
    id=Z3_LEAF_INPUT_NO_GRAD.id, title=Z3_LEAF_INPUT_NO_GRAD.title, checks=("exception",),
    releases=Z3_LEAF_INPUT_NO_GRAD.releases, fixed_in=None, runtime_prevents=True,  # runtime/leaf_deferral.py
    detail=Z3_LEAF_INPUT_NO_GRAD.detail,
    needs=lambda ctx: ctx.get("stage") == 3 and ctx.get("leaf_without_grad", False) and any(
        s in ctx.get("error", "") for s in ("must match the size", "Cannot reduce scatter")))

Z3_LEAF_GATHERED = Explanation(
    id=Z3_LEAF_KEPT_GATHERED.id, title=Z3_LEAF_KEPT_GATHERED.title, checks=("released-after-backward",),
    releases=Z3_LEAF_KEPT_GATHERED.releases, fixed_in=None, runtime_prevents=True,  # runtime/leaf_reuse_walk.py
    detail=Z3_LEAF_KEPT_GATHERED.detail,
    needs=lambda ctx: ctx.get("stage") == 3 and bool(ctx.get("leaves")))

Z3_LEFTOVERS = Explanation(
    id=Z3_NO_POST_BACKWARD_NO_DRAIN.id, title=Z3_NO_POST_BACKWARD_NO_DRAIN.title, checks=("released-after-backward",),
    releases=Z3_NO_POST_BACKWARD_NO_DRAIN.releases, fixed_in=Z3_NO_POST_BACKWARD_NO_DRAIN.fixed_in,
    runtime_prevents=True,  # runtime/release_policy.py release_backward_leftovers, on releases without the drain
    detail=Z3_NO_POST_BACKWARD_NO_DRAIN.detail,
    # the evidence: every parameter the violation names was left gathered or held by a module whose pre-backward
    # ran in that backward and whose post-backward did not (the tracer's `backward_leftovers`)
    needs=lambda ctx: ctx.get("stage") == 3 and bool(ctx.get("named_leftovers")))

ZERO12_NO_GRAD = Explanation(
    id=ZERO12_NO_GRADIENT.id, title=ZERO12_NO_GRADIENT.title, checks=("exception",),
    releases=ZERO12_NO_GRADIENT.releases, fixed_in=None, runtime_prevents=False, detail=ZERO12_NO_GRADIENT.detail,
    needs=lambda ctx: ctx.get("stage") in (1, 2) and any(s in ctx.get("error", "") for s in ("IndexError", "KeyError")))

EXPLANATIONS: tuple[Explanation, ...] = (SEED_002, SEED_000_PART1, SEED_000_PART2, Z3_LEAF_INPUT, Z3_LEFTOVERS,
                                         Z3_LEAF_GATHERED, ZERO12_NO_GRAD)


def explain(check: str, version: str | None, ctx: dict) -> Explanation | None:
    """The known issue that explains ``check`` (a spec id or ``exception``) on ``version`` given ``ctx``."""
    try:
        v = compat.version_tuple(version) if version else None
    except Exception:
        v = None
    for e in EXPLANATIONS:
        ctx = dict(ctx, check=check)
        if check in e.checks and (v is None or e.releases[0] <= v < e.releases[1]) and e.needs(ctx):
            return e
    return None


__all__ = ["EXPLANATIONS", "Explanation", "explain"]
