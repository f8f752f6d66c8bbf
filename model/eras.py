"""The one era table: which DeepSpeed releases behave how, for every part of zerostate.

Each row is a half-open range of releases ``first <= version < end`` with

* ``design``: the model design (hook half + coordinator half) the release implements -- what the
  deepspeed target's model-agreement check predicts (`zerostate.model.designs.design_for_release`);
* ``hook_design`` / ``coordinator_design``: the design of each half, by name;
* ``tracer``: the deepspeed target's tracer supports the release (`tracing/compat.py`);
* ``runtime_hooks``: how `zerostate.runtime` replaces the hook closures (``count-every-hook``: they call
  ``count_used_parameters_in_backward`` unconditionally and are swapped; ``refresh-gated``: they ask
  ``should_refresh_expected_hook_count`` first and are kept), or None where the runtime refuses;
* ``runtime_release_policy``: ``plain`` (no recompute attribution) or ``owner-attribution``
  (PR #8148), or None where the ZeRO-3 release policy is refused.

Adding a DeepSpeed release is one row (or widening one).  Pure data: no torch, no deepspeed.
"""

from __future__ import annotations

import re
from typing import NamedTuple

Release = tuple[int, int, int]


class Era(NamedTuple):
    """One row (a NamedTuple, not a dataclass: repro scripts embed this file and may run under any module name)."""

    first: Release
    end: Release
    """Exclusive."""
    design: str
    hook_design: str
    coordinator_design: str
    tracer: bool
    runtime_hooks: str | None
    runtime_release_policy: str | None
    note: str

    def holds(self, release: Release) -> bool:
        return self.first <= release < self.end


ERAS: tuple[Era, ...] = (
    Era((0, 18, 4), (0, 18, 5), "ds-0.18.4", "ds-0.18.4", "ds-0.19.2", True, None, None,
        "remaining-hooks counter re-armed by one count; epilogue when it hits 0 (seed 000 part 1, fixed by #7780)"),
    Era((0, 18, 5), (0, 18, 7), "ds-0.18.5", "ds-0.18.5", "ds-0.19.2", True, "count-every-hook", "plain",
        "BackwardHookStateManager + queued callback (PR #7780); count in every hook (#7882/#7885)"),
    Era((0, 18, 7), (0, 19, 0), "ds-0.19.2", "ds-0.18.7", "ds-0.19.2", True, "refresh-gated", "plain",
        "PR #7886: hooks gate the count on should_refresh_expected_hook_count"),
    Era((0, 19, 0), (0, 19, 3), "ds-0.19.2", "ds-0.18.7", "ds-0.19.2", True, "refresh-gated", "plain",
        "the coordinator partitions recompute-fetched frozen params (seed 002's CheckpointError)"),
    Era((0, 19, 3), (0, 19, 9), "ds-0.19.3", "ds-0.18.7", "ds-0.19.3", True, "refresh-gated", "owner-attribution",
        "PR #8148: recompute-fetched frozen params attributed to the active backward module"),
    Era((0, 19, 9), (0, 20, 0), "ds-0.19.3", "ds-0.18.7", "ds-0.19.3", True, None, None,
        "releases after the pinned 0.19.8: traced as 0.19.x; the runtime refuses them until checked"),
)


class UnknownRelease(ValueError):
    """A version string that is not a DeepSpeed release number."""


def parse_release(version: str) -> Release:
    """``0.19.8``, ``0.19.8+cpu``, ``v0.19.3rc1`` -> ``(0, 19, 8)``; anything else raises `UnknownRelease`."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if not m:
        raise UnknownRelease(f"cannot read a DeepSpeed release number from {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def era_of(release: Release) -> Era | None:
    return next((e for e in ERAS if e.holds(release)), None)


def fmt(release: Release) -> str:
    return ".".join(map(str, release))


def span(rows: list[Era] | tuple[Era, ...]) -> str:
    """``0.18.4 <= version < 0.20.0`` for consecutive rows."""
    return f"{fmt(rows[0].first)} <= version < {fmt(rows[-1].end)}"


__all__ = ["ERAS", "Era", "Release", "UnknownRelease", "era_of", "fmt", "parse_release", "span"]
