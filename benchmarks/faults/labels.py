"""Whether a label a faulted run's new finding carries is the fault read as known, or the release's own bug.

A faulted exploration reaches other scenarios than the unfaulted one (a fault changes which examples fail, so
what is shrunk and completed), so some of its new keys are the release's own known bugs met on the way.  A label
on such a finding is right.  A label is *wrong* -- the fault read as "known, not yours" -- only when the unfaulted
release does not show that known issue on the finding's own scenario: each labelled new finding is replayed on the
unfaulted tree in a fresh worker (up to `REPEAT` times: an intermittent known bug must get its chances), and only
those whose replays never show the label are counted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

REPEAT = 2


def labels_of(answer: dict[str, Any]) -> list[str]:
    """The known issues a ``zerostate replay --json`` answer's finding is labelled with (first, then a sum's)."""
    known = answer.get("known_issue") or {}
    ids = [known.get("id")] + [a.get("id") for a in known.get("also") or ()]
    return [str(i) for i in ids if i]


def label_shown(answer: dict[str, Any], label: str) -> bool:
    """A replay answer (``zerostate replay --json``'s, or its short form here) failed with the known issue ``label``
    among its labels."""
    ids = answer["labels"] if "labels" in answer else labels_of(answer)
    return answer.get("passed") is False and label in ids


def replay_labels(candidates: list[dict[str, Any]], report: dict[str, Any], out: Path,
                  replay: Callable[[Path, Path], dict[str, Any]], logs: Path) -> list[dict[str, Any]]:
    """Each candidate (``{"key", "label"}``: a new finding labelled by another issue than the fault's) replayed on
    the unfaulted tree through ``replay(finding_file, log)``: the candidate with ``shown_unfaulted`` (the release
    shows the label on that scenario), ``replays`` (their short answers) or ``error`` when it has no finding file."""
    entries = {e.get("key"): e for e in report.get("findings", [])}
    rows = []
    for i, c in enumerate(candidates):
        entry = entries.get(c["key"])
        if entry is None or not (entry.get("files") or {}).get("scenario"):
            rows.append({**c, "shown_unfaulted": None, "error": "no finding file in the report"})
            continue
        answers = []
        for n in range(REPEAT):
            a = replay(out / entry["files"]["scenario"], logs.with_name(f"{logs.name}-{i}-{n}.log"))
            answers.append({k: a.get(k) for k in ("passed", "key", "error")} | {"labels": labels_of(a)})
            if label_shown(a, c["label"]):
                break
        rows.append({**c, "shown_unfaulted": any(label_shown(a, c["label"]) for a in answers), "replays": answers})
    return rows


def still_wrong(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidates whose label the unfaulted release did not show on their own scenario (or could not be
    replayed: unknown is not cleared)."""
    return [{"key": r["key"], "label": r["label"]} for r in rows if not r.get("shown_unfaulted")]


__all__ = ["REPEAT", "label_shown", "labels_of", "replay_labels", "still_wrong"]
