"""What explains a violation `zerostate watch` sees on a user's job: the known issues of the one table
(`known.issues`) that a watched job can show, and what in the job must be seen for each to apply.

Each watched issue names the checks it shows as there (a spec id or ``exception``) and ``needs``: what the
watcher saw of the job (``ctx``: ``stage``, ``leaf_without_grad``, ``leaves``, ``nonreentrant``, ``error``) that its
mechanism requires -- a z3 leaf module fed without grad, a CheckpointError, ...  The record (id, title,
releases, first fixed release, whether ``zerostate.runtime`` prevents it, detail) is the table's.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from zerostate.known.issue import KnownIssue
from zerostate.known.seeds import SEED_000_PART1, SEED_000_PART2, SEED_002
from zerostate.known.zero_hooks import (Z3_LEAF_INPUT_NO_GRAD, Z3_LEAF_KEPT_GATHERED, Z3_NO_POST_BACKWARD_NO_DRAIN,
                                        ZERO12_NO_GRADIENT)
from zerostate.tracing import compat

Context = dict[str, Any]


@dataclass(frozen=True)
class Watched:
    """A known issue as the watch recognises it."""

    issue: KnownIssue
    checks: tuple[str, ...]
    needs: Callable[[Context], bool]

    @property
    def id(self) -> str:
        return self.issue.id

    @property
    def fixed_in(self) -> str | None:
        return self.issue.fixed_in

    @property
    def runtime_prevents(self) -> bool:
        return self.issue.runtime_prevents

    def to_dict(self) -> dict[str, Any]:
        k = self.issue
        return {"id": k.id, "title": k.title, "fixed_in": k.fixed_in, "runtime_prevents": k.runtime_prevents,
                "detail": k.detail}


def _checkpoint_error(ctx: Context) -> bool:
    return ctx.get("check") != "exception" or any(s in ctx.get("error", "") for s in (
        "CheckpointError", "different metadata"))


WATCHED: tuple[Watched, ...] = (
    Watched(SEED_002, ("saved-tensor-intact", "exception"),
            lambda ctx: ctx.get("stage") == 3 and _checkpoint_error(ctx)),
    Watched(SEED_000_PART1, ("epilogue-once", "grad-handled-once", "clean-step"), lambda ctx: True),
    Watched(SEED_000_PART2, ("count-once-per-phase",), lambda ctx: True),
    Watched(Z3_LEAF_INPUT_NO_GRAD, ("exception",),
            lambda ctx: ctx.get("stage") == 3 and ctx.get("leaf_without_grad", False) and any(
                s in ctx.get("error", "") for s in ("must match the size", "Cannot reduce scatter"))),
    # every parameter the violation names was left gathered or held by a module whose pre-backward ran in that
    # backward and whose post-backward did not (the watch tracer's ``named_leftovers``)
    Watched(Z3_NO_POST_BACKWARD_NO_DRAIN, ("released-after-backward",),
            lambda ctx: ctx.get("stage") == 3 and bool(ctx.get("named_leftovers"))),
    Watched(Z3_LEAF_KEPT_GATHERED, ("released-after-backward",),
            lambda ctx: ctx.get("stage") == 3 and bool(ctx.get("leaves"))),
    Watched(ZERO12_NO_GRADIENT, ("exception",),
            lambda ctx: ctx.get("stage") in (1, 2) and any(
                s in ctx.get("error", "") for s in ("IndexError", "KeyError"))),
)


def explain(check: str, version: str | None, ctx: Context) -> Watched | None:
    """The known issue that explains ``check`` (a spec id or ``exception``) on ``version`` given ``ctx``."""
    try:
        v = compat.version_tuple(version) if version else None
    except compat.UnsupportedRelease:
        v = None
    ctx = dict(ctx, check=check)
    for w in WATCHED:
        lo, hi = w.issue.releases
        if check in w.checks and (v is None or lo <= v < hi) and w.needs(ctx):
            return w
    return None


__all__ = ["WATCHED", "Watched", "explain"]
