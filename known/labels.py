"""Label each finding with the known issue that explains it, and group findings sharing a root cause.

The one labelling step is `labelled`: it returns the finding with ``known`` (the issue's id) and ``group``
set, from the one table (`known.issues.explain`).  Reports (explore, diff, watch) read the same table
through `label` / `annotate` / `groups`, so a reader can tell the new from the known and see that several
findings are one bug::

    from zerostate.known.labels import labelled, label, group_key, groups
    f = labelled(f)               # Finding with known / group set
    lab = label(f)                # {"id", "title", "owner", "fixed_in", "upstream_patch"} or None
    key = group_key(f)            # the known issue's id, else the root-cause key
    groups(entries)               # report entries -> [{"key", "title", "known_issue", "count", "findings"}]

A finding is labelled only on a release the issue affects, and only when it names its release (a model
design's finding is not: the table describes real DeepSpeed).

Without a label, findings share a root cause when they show the same exception or the same spec
violation whatever the backward kind: an ``exception``'s key includes the DeepSpeed frame it was raised
in, which differs between ``engine.backward`` and ``loss.backward`` for one bug, so the root key is the
check plus the *shape* of the error's last line (`findings.finding.message_shape`: names and numbers blanked).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zerostate.findings.finding import Finding, message_shape
from zerostate.findings.fingerprint import placement
from zerostate.findings.harness import harness_error
from zerostate.known.issue import KnownIssue
from zerostate.known.issues import explain_all
from zerostate.tracing import compat


def issues_of(f: Finding) -> tuple[KnownIssue, ...]:
    """The known issues explaining ``f`` on the release it was found on (several: a sum of known mechanisms);
    none without a release, and for a harness error (`findings.harness`: zerostate's own failure is no DeepSpeed
    issue)."""
    if not f.deepspeed or harness_error(f):
        return ()
    try:
        compat.version_tuple(f.deepspeed)
    except compat.UnsupportedRelease:
        return ()
    return explain_all(f)


def issue_of(f: Finding) -> KnownIssue | None:
    """The (first) known issue explaining ``f`` (`issues_of`)."""
    found = issues_of(f)
    return found[0] if found else None


def labelled(f: Finding) -> Finding:
    """``f`` with its known issue (``known``, and ``also_known`` for a sum) and root-cause group (``group``): the
    one labelling step."""
    found = issues_of(f)
    ids = tuple(k.id for k in found)
    return replace(f, known=ids[0] if ids else "", also_known=ids[1:], group="+".join(ids) if ids else root_key(f))


def label(f: Finding) -> dict[str, Any] | None:
    """The known issue explaining ``f`` on the release it was found on: id, title, owner, fixed_in; for a sum of
    known mechanisms the first, with ``also``: the others' ids and titles."""
    found = issues_of(f)
    if not found:
        return None
    k = found[0]
    out: dict[str, Any] = {"id": k.id, "title": k.title, "owner": k.owner, "fixed_in": k.fixed_in,
                           "upstream_patch": k.upstream_patch, "nature": k.nature.value, "cites": k.cites or None}
    if found[1:]:
        out["also"] = [{"id": o.id, "title": o.title} for o in found[1:]]
    return out


def root_key(f: Finding) -> str:
    """The check plus the shape of what went wrong, independent of the backward kind; a raised one (an exception, a
    saved tensor changed) also by which backward raised it (`findings.fingerprint.placement`, as its key); for an
    oracle difference its key (what its run shows of the update: `findings.oracle_class`)."""
    if harness_error(f):
        return f"harness error: {harness_error(f)}"
    lines = [ln.strip() for ln in (f.error or "").strip().splitlines() if ln.strip()]
    if f.check == "oracle" and f.evidence.oracle is not None:  # its message names parameters; its key the mechanism
        return f.key
    # a spec's own violation (no exception) is placed by its event, in its key: the trace's end says nothing of it
    where = placement(f.check, f.trace, f.evidence.raised) if f.check == "exception" or f.evidence.raised is not None \
        else ""
    at = f" @{where}" if where else ""
    if f.check in ("exception", "crash", "hang", "internal") and lines:
        exc = next((ln for ln in reversed(lines) if _looks_like_exception(ln)), lines[0])
        return f"{f.check}: {message_shape(exc)}{at}"
    return f"{f.check}: {message_shape(lines[0])}{at}" if lines else f.check


def group_key(f: Finding) -> str:
    found = issues_of(f)
    return "+".join(k.id for k in found) if found else root_key(f)


def group_title(f: Finding) -> str:
    found = issues_of(f)
    return " + ".join(k.title for k in found) if found else root_key(f)


def annotate(f: Finding) -> dict[str, Any]:
    """What a report entry records of a finding for labelling and grouping; ``harness_error`` says why it is
    zerostate's own failure (None: a finding about DeepSpeed)."""
    return {"known_issue": label(f), "group": group_key(f), "group_title": group_title(f),
            "harness_error": harness_error(f)}


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
    return head.replace(".", "").replace("_", "").isalnum() and (
        head.endswith(("Error", "Exception")) or head in ("KeyError", "AssertionError", "StopIteration"))


__all__ = ["annotate", "group_key", "group_title", "groups", "issue_of", "issues_of", "label", "labelled", "root_key"]
