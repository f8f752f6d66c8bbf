"""The release matrix's cells: one `MatrixRow` per finding key over every column, its cells from the columns'
own explorations (`rows_of`), the cells they left empty filled by replaying the finding's scenario on that
column in a fresh worker (`replay_cells`), each replay written to ``OUT/replays/<n>-<column>.json``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Target

from zerostate.explorer.workers import has_run, refresh

from zerostate.reports.matrix_model import ABSENT, CRASHED, PRESENT, Cell, Column, ColumnExploration, MatrixRow

_STOPPED = frozenset({"exception", "crash", "hang", "internal"})


def cell_of(out: Outcome, key: str) -> tuple[str, str]:
    """A replay's cell: ``present`` when it shows ``key``; ``crashed before`` when the release stopped first
    (raised, crashed, hung); else ``absent``.  With the first line of what it showed instead."""
    if any(f.key == key for f in out.findings):
        return PRESENT, ""
    stopped = [f for f in out.findings if f.check in _STOPPED]
    if stopped or out.error:
        first = stopped[0].error if stopped else out.error or ""
        return CRASHED, (stopped[0].check + ": " if stopped else "") + first_line(first)
    others = ", ".join(sorted({f.key for f in out.findings}))
    return ABSENT, (f"other findings: {others}" if others else "clean")


def first_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[0][:200] if lines else ""


def replay_cells(rows: Sequence[MatrixRow], cols: Sequence[Column], explored: Mapping[str, ColumnExploration],
                 out: Path, make_target: Callable[[Column], Target], side_by_side: bool) -> list[MatrixRow]:
    """``rows`` with every cell the explorations left empty filled by replaying the finding's scenario on that
    column (its cells in column order: the explorations', then the replays')."""
    releases = [c.name for c in cols]
    by_name = {c.name: c for c in cols}
    todo: dict[str, list[MatrixRow]] = {r: [] for r in releases}
    for row in rows:
        for r in releases:
            if r not in row.cells and explored[r].explored:
                todo[r].append(row)
    (out / "replays").mkdir(exist_ok=True)
    filled: dict[str, dict[int, Cell]] = {r: {} for r in releases}

    def one_release(r: str) -> None:
        if not todo[r]:
            return
        t = make_target(by_name[r])
        try:
            for row in todo[r]:
                filled[r][row.n] = _replay(t, row, by_name[r], out)
        finally:
            t.close()

    with ThreadPoolExecutor(max_workers=len(releases) if side_by_side else 1) as pool:
        list(pool.map(one_release, releases))
    return [replace(row, cells={**row.cells, **{r: filled[r][row.n] for r in releases if row.n in filled[r]}})
            for row in rows]


def _replay(t: Target, row: MatrixRow, col: Column, out: Path) -> Cell:
    """The finding's scenario (after its sequence, for an order-dependent one) in a fresh worker of ``t``."""
    release = col.name
    if has_run(t):
        refresh(t)
    for sc in row.sequence:
        t.run(sc)
    o = t.run(row.scenario)
    status, detail = cell_of(o, row.key)
    rel = f"replays/{row.n}-{release}.json"
    command = f"zerostate replay {row.source_file}{col.replay_args()}" + _ws(row)
    (out / rel).write_text(json.dumps({
        "release": release, "finding": row.n, "key": row.key, "status": status, "detail": detail,
        "command": command, "scenario": row.scenario.to_dict(),
        "sequence": [s.to_dict() for s in row.sequence],
        "outcome": {"error": first_line(o.error or ""), "findings": [{"check": f.check, "key": f.key,
                                                                       "error": first_line(f.error)}
                                                                      for f in o.findings]},
    }, indent=2) + "\n")
    return Cell(status, "replay", rel, command, detail)


def _sequence(finding_file: Path) -> tuple[Scenario, ...]:
    """An order-dependent finding's examples to run first (its finding file's ``sequence``)."""
    try:
        data = json.loads(finding_file.read_text())
    except (OSError, ValueError):
        return ()
    return tuple(Scenario.from_dict(d) for d in data.get("sequence") or [])


def _ws(row: MatrixRow) -> str:
    ws = max(row.scenario.world_size, row.world_size)
    return f" --world-size {ws}" if ws > 1 else ""


def rows_of(cols: Sequence[Column], explored: Mapping[str, ColumnExploration], world_size: int = 1) -> list[MatrixRow]:
    """One row per finding key, in the order of the first column that found it and its number there; the
    cells its own explorations give.  ``world_size``: the matrix's (``--world-size``); a row replays at it, or at
    its scenario's when that is larger."""
    rows: dict[str, MatrixRow] = {}
    for col in cols:
        r = col.name
        for f in explored[r].findings:
            key = f.key or f.check
            link = f"{explored[r].out}/finding_{f.n}.json"
            if key not in rows:
                rows[key] = MatrixRow(key, f.check, first_line(f.error), f.known_issue, r, link,
                                      Scenario.from_dict(dict(f.scenario)),
                                      _sequence(Path(explored[r].path) / f"finding_{f.n}.json"), world_size)
            row = rows[key]
            cell = Cell(PRESENT, "exploration", link, f"zerostate replay {link}{col.replay_args()}" + _ws(row), "")
            rows[key] = replace(row, cells={**row.cells, r: cell})
    return [replace(row, n=n) for n, row in enumerate(rows.values(), 1)]


__all__ = ["cell_of", "first_line", "replay_cells", "rows_of"]
