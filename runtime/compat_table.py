"""The releases the runtime supports and how their gradient hooks are shaped: `COMPAT`.

`COMPAT` is the runtime's rows of the project's one era table (`zerostate.model.eras.ERAS`): per release
range, the shape of DeepSpeed's gradient-hook closures (``count-every-hook``: 0.18.5 and 0.18.6 call
``count_used_parameters_in_backward`` in every hook, the quadratic cost of deepspeedai/DeepSpeed#7882,
fixed by #7886's ``refresh-gated`` closures in 0.18.7) and which release policy applies
(``owner-attribution`` from PR #8148 on).  `compat_row` is the one place a release is looked up; a
release outside every row is refused before anything is changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerostate.model.eras import ERAS, UnknownRelease, parse_release

from .errors import UnsupportedDeepSpeedError


@dataclass(frozen=True)
class CompatRow:
    first: tuple[int, int, int]
    end: tuple[int, int, int]
    """Exclusive."""
    hook_closures: str
    """``count-every-hook``: closures call count_used_parameters_in_backward unconditionally and are
    replaced; ``refresh-gated``: closures ask ``should_refresh_expected_hook_count`` first (kept)."""
    release_policy: str | None
    """``plain`` (no recompute attribution), ``owner-attribution`` (PR #8148), or None (not supported)."""
    note: str


COMPAT: tuple[CompatRow, ...] = tuple(
    CompatRow(e.first, e.end, e.runtime_hooks, e.runtime_release_policy, e.note) for e in ERAS if e.runtime_hooks)
"""The runtime's rows of the era table (0.18.5 <= version < 0.19.9).  Releases outside every row are refused."""


def supported_range() -> str:
    return f"{fmt(COMPAT[0].first)} <= version < {fmt(COMPAT[-1].end)}"


def release_policy_range() -> str:
    return f"{fmt(next(r.first for r in COMPAT if r.release_policy))} <= version < {fmt(COMPAT[-1].end)}"


def fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def parse_version(version: str) -> tuple[int, int, int]:
    try:
        return parse_release(version)
    except UnknownRelease as exc:
        raise UnsupportedDeepSpeedError(f"{exc}; zerostate.runtime supports DeepSpeed {supported_range()}. "
                                        "Nothing was changed.") from None


def compat_row(version: str) -> CompatRow:
    v = parse_version(version)
    for row in COMPAT:
        if row.first <= v < row.end:
            return row
    raise UnsupportedDeepSpeedError(
        f"zerostate.runtime supports DeepSpeed {supported_range()} (hook state) and {release_policy_range()} "
        f"(ZeRO-3 recompute release policy); the installed DeepSpeed is {version}. Nothing was changed.")


__all__ = ["COMPAT", "CompatRow", "compat_row", "fmt", "parse_version", "release_policy_range", "supported_range"]
