"""Label each finding with the known issue that explains it, and group findings sharing a root cause.

Reports (explore, diff; watch later) call these so a reader can tell the new from the known and see
that several findings are one bug::

    from zerostate.known.labels import label, group_key, group_title, groups
    lab = label(finding)          # {"id", "title", "owner", "fixed_in"} or None
    key = group_key(finding)      # the known issue's id, else the root-cause key
    groups(entries)               # report entries -> [{"key", "title", "known_issue", "count", "findings"}]

Labels come from `targets.deepspeed.known`: its `KnownIssue` entries (the DeepSpeed bugs and model gaps
on the pinned release; ``fixed_in`` is the first release without it, None while unfixed) and its seed bugs
(`SEED_BUGS`: DeepSpeed #7882/#7885 fixed in 0.18.5, seed 000 part 2 fixed in 0.18.7, seed 002 fixed
in 0.19.3), each only on a release it affects.

Without a label, findings share a root cause when they show the same exception or the same spec
violation whatever the backward kind: an ``exception``'s key includes the DeepSpeed frame it was raised
in, which differs between ``engine.backward`` and ``loss.backward`` for one bug, so the root key is the
check plus the *shape* of the error's last line (`base.message_shape`: names and numbers blanked).
"""

from __future__ import annotations

from typing import Any

from zerostate.findings.finding import Finding, message_shape

SEED_LABELS = (
    # (id, title, release range [lo, hi), first fixed release, predicate name in known.py)
    ("seed-000-part-1", "ZeRO-3: premature epilogue of a reentrant-checkpointed PyTorch-style backward "
     "(DeepSpeed #7882/#7885)", ((0, 18, 4), (0, 18, 5)), "0.18.5", "is_seed_000_part1"),
    ("seed-000-part-2", "count_used_parameters_in_backward counted in every gradient hook, not once per "
     "backward phase", ((0, 18, 5), (0, 18, 7)), "0.18.7", "is_seed_000_part2"),
    ("seed-002", "ZeRO-3: a frozen parameter partitioned during a non-reentrant recompute (CheckpointError)",
     ((0, 18, 4), (0, 19, 3)), "0.19.3", "is_seed_002"),  # measured present on 0.18.4, 0.18.7, 0.19.2
)


def label(f: Finding) -> dict[str, Any] | None:
    """The known issue explaining ``f`` on the release it was found on: id, title, owner, fixed_in."""
    if not f.deepspeed:
        return None  # a model design's finding: known.py describes real DeepSpeed only
    from zerostate.tracing import compat
    from zerostate.known import issues as known
    k = known.explain(f)
    if k is not None:
        return {"id": k.id, "title": k.title, "owner": k.owner, "fixed_in": getattr(k, "fixed_in", None),
                "upstream_patch": getattr(k, "upstream_patch", None)}
    try:
        v = compat.version_tuple(f.deepspeed)
    except compat.UnsupportedRelease:
        return None
    for sid, title, (lo, hi), fixed, pred in SEED_LABELS:
        if lo <= v < hi and getattr(known, pred)(f):
            return {"id": sid, "title": title, "owner": "deepspeed", "fixed_in": fixed}
    return None


def root_key(f: Finding) -> str:
    """The check plus the shape of what went wrong, independent of the backward kind."""
    lines = [ln.strip() for ln in (f.error or "").strip().splitlines() if ln.strip()]
    if f.check in ("exception", "crash", "hang", "internal") and lines:
        exc = next((ln for ln in reversed(lines) if _looks_like_exception(ln)), lines[0])
        return f"{f.check}: {message_shape(exc)}"
    return f"{f.check}: {message_shape(lines[0])}" if lines else f.check


def group_key(f: Finding) -> str:
    lab = label(f)
    return lab["id"] if lab else root_key(f)


def group_title(f: Finding) -> str:
    lab = label(f)
    return lab["title"] if lab else root_key(f)


def annotate(f: Finding) -> dict[str, Any]:
    """What a report entry records of a finding for labelling and grouping."""
    return {"known_issue": label(f), "group": group_key(f), "group_title": group_title(f)}


def groups(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Report entries carrying `annotate`'s fields (and ``n``) -> one group per root cause, in order of
    first appearance, each with its finding numbers and count."""
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        key = e.get("group")
        if key is None:
            continue
        g = out.setdefault(key, {"key": key, "title": e.get("group_title") or key,
                                 "known_issue": e.get("known_issue"), "count": 0, "findings": []})
        g["count"] += 1
        g["findings"].append(e.get("n"))
    return list(out.values())


def _looks_like_exception(line: str) -> bool:
    head = line.split(":", 1)[0]
    return head.replace(".", "").replace("_", "").isalnum() and (head.endswith("Error") or head.endswith(
        "Exception") or head in ("KeyError", "AssertionError", "StopIteration"))


__all__ = ["SEED_LABELS", "annotate", "group_key", "group_title", "groups", "label", "root_key"]
