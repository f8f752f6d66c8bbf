"""The release matrix's report: ``report.md`` (first table: finding x release) and ``report.json``, from its
`MatrixReport`."""

from __future__ import annotations

import json
from pathlib import Path

from zerostate.atomic import replace_file

from zerostate.reports.matrix_model import Cell, ColumnExploration, MatrixReport

_MARK = {"present": "**present**", "absent": "absent", "crashed before": "crashed before"}


def write(out: Path, report: MatrixReport) -> None:
    replace_file(str(out / "report.json"), json.dumps(report.to_json(), indent=2) + "\n")
    replace_file(str(out / "report.md"), render(report))


def render(d: MatrixReport) -> str:
    releases = d.releases
    ex = d.explorations
    out = ["# zerostate release matrix", ""]
    if d.status != "complete":
        out += [f"**Status: {d.status}** -- the cells below are what was known when it stopped.", ""]
    out += ["| finding | " + " | ".join(releases) + " |", "|---" * (len(releases) + 1) + "|"]
    for r in d.findings:
        known = f" [{r.known_issue}]" if r.known_issue else ""
        cells = [_cell(r.cells.get(v), ex[v]) for v in releases]
        out.append(f"| #{r.n} `{r.key}`{known} | " + " | ".join(cells) + " |")
    if not d.findings:
        out.append("| (no finding on any release) | " + " | ".join("—" for _ in releases) + " |")
    out += ["", ("present: the release shows it (found by its exploration, or its scenario replayed there shows "
                 "it: *by replay*); absent: its scenario replayed there in a fresh worker runs without it; crashed "
                 "before: that replay raised, crashed or hung first, so the check could not be judged.  Every cell "
                 "links the finding file or the replay it rests on."), ""]
    out += ["## Explorations", "", "| release | status | distinct runs | findings | report |", "|---|---|---|---|---|"]
    for v in releases:
        e = ex[v]
        status = e.status if e.explored else f"**not explored**: {e.error or ''}"
        found = len(e.findings) if e.explored else "—"
        link = f"[{e.out}/report.md]({e.out}/report.md)"
        out.append(f"| {v} | {status} | {e.examples if e.explored else '—'} | {found} | {link} |")
    out += ["", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in d.run.to_json().items() if v is not None]
    out += ["", "## Findings", ""]
    for r in d.findings:
        src = f"[{r.source_file}]({r.source_file})"
        out += [f"### #{r.n} `{r.key}`", "", f"- first found on {r.source}: {src}",
                f"- {r.check}: {r.error}", f"- scenario: {r.scenario.describe()}", ""]
        for v in releases:
            c = r.cells.get(v)
            if c:
                out.append(f"  - {v}: {c.status} ({c.by}{': ' + c.detail if c.detail else ''}) -- `{c.replay}`")
        out.append("")
    return "\n".join(out) + "\n"


def _cell(c: Cell | None, exploration: ColumnExploration) -> str:
    if c is None:
        return "not explored" if not exploration.explored else "—"
    mark = _MARK.get(c.status, c.status)
    return f"[{mark}{' (by replay)' if c.by == 'replay' and c.status == 'present' else ''}]({c.link})"


__all__ = ["render", "write"]
