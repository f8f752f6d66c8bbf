"""The release matrix's report: ``report.md`` (first table: finding x release) and ``report.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerostate.atomic import replace_file

_MARK = {"present": "**present**", "absent": "absent", "crashed before": "crashed before"}


def to_json(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**{k: v for k, v in r.items() if k not in ("scenario", "sequence")},
             "scenario": r["scenario"].to_dict(), "description": r["scenario"].describe()} for r in rows]


def write(out: Path, result: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    data = {**result, "findings": to_json(rows)}
    replace_file(str(out / "report.json"), json.dumps(data, indent=2) + "\n")
    replace_file(str(out / "report.md"), render(data))


def render(d: dict[str, Any]) -> str:
    releases: list[str] = d["releases"]
    ex = d["explorations"]
    out = ["# zerostate release matrix", ""]
    if d["status"] != "complete":
        out += [f"**Status: {d['status']}** -- the cells below are what was known when it stopped.", ""]
    out += ["| finding | " + " | ".join(releases) + " |", "|---" * (len(releases) + 1) + "|"]
    for r in d["findings"]:
        known = f" [{r['known_issue']}]" if r.get("known_issue") else ""
        cells = [_cell(r["cells"].get(v), ex[v]) for v in releases]
        out.append(f"| #{r['n']} `{r['key']}`{known} | " + " | ".join(cells) + " |")
    if not d["findings"]:
        out.append("| (no finding on any release) | " + " | ".join("—" for _ in releases) + " |")
    out += ["", ("present: the release shows it (found by its exploration, or its scenario replayed there shows "
                 "it: *by replay*); absent: its scenario replayed there in a fresh worker runs without it; crashed "
                 "before: that replay raised, crashed or hung first, so the check could not be judged.  Every cell "
                 "links the finding file or the replay it rests on."), ""]
    out += ["## Explorations", "", "| release | status | distinct runs | findings | report |", "|---|---|---|---|---|"]
    for v in releases:
        e = ex[v]
        status = e["status"] if e["status"] != "not explored" else f"**not explored**: {e.get('error', '')}"
        found = len(e.get("findings") or []) if e["status"] != "not explored" else "—"
        link = f"[{e['out']}/report.md]({e['out']}/report.md)"
        out.append(f"| {v} | {status} | {e.get('examples', '—')} | {found} | {link} |")
    run = d["run"]
    out += ["", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in run.items() if v is not None]
    out += ["", "## Findings", ""]
    for r in d["findings"]:
        src = f"[{r['source_file']}]({r['source_file']})"
        out += [f"### #{r['n']} `{r['key']}`", "", f"- first found on {r['source']}: {src}",
                f"- {r['check']}: {r['error']}", f"- scenario: {r['description']}", ""]
        for v in releases:
            c = r["cells"].get(v)
            if c:
                out.append(f"  - {v}: {c['status']} ({c['by']}{': ' + c['detail'] if c['detail'] else ''}) -- "
                           f"`{c['replay']}`")
        out.append("")
    return "\n".join(out) + "\n"


def _cell(c: dict[str, Any] | None, exploration: dict[str, Any]) -> str:
    if c is None:
        return "not explored" if exploration["status"] == "not explored" else "—"
    mark = _MARK.get(c["status"], c["status"])
    return f"[{mark}{' (by replay)' if c['by'] == 'replay' and c['status'] == 'present' else ''}]({c['link']})"


__all__ = ["render", "to_json", "write"]
