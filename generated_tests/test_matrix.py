"""The release matrix (`cli/matrix.py`): one report, a cell per column and finding, each with its replay.

Installing and exploring three real DeepSpeed releases is tens of minutes, too slow for CI: here the model
target's designs stand in as the columns (``--target model --design ds-0.18.4,ds-0.18.5,zerostate``), which
runs the same matrix code (explorations, rows, replays into the empty cells, the report) on a pure function.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

COLUMNS = ("ds-0.18.4", "ds-0.18.5", "zerostate")


BIN = Path(sys.executable).parent / "zerostate"
"""The installed command: run from the report's folder, ``python -m`` would import its ``zerostate/`` column
folder as the package."""


def _zerostate(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "zerostate.cli.main"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "CI": "true"}, cwd=cwd)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("matrix")
    p = _zerostate("explore", "--target", "model", "--design", ",".join(COLUMNS), "--examples", "10",
                   "--out", str(out))
    return p, out


def test_one_report_has_a_cell_per_finding_and_column(matrix):
    p, out = matrix
    assert p.returncode == 1, p.stdout + p.stderr  # findings
    report = json.loads((out / "report.json").read_text())
    assert report["releases"] == list(COLUMNS) and report["status"] == "complete"
    rows = report["findings"]
    assert rows, "the buggy designs have findings"
    for row in rows:
        assert set(row["cells"]) == set(COLUMNS), row
        for cell in row["cells"].values():
            assert (out / cell["link"]).is_file(), cell
    # the fixed design: nothing found by its own exploration, every finding absent there by replay
    assert report["explorations"]["zerostate"]["findings"] == []
    assert {r["cells"]["zerostate"]["status"] for r in rows} == {"absent"}
    assert {r["cells"]["zerostate"]["by"] for r in rows} == {"replay"}
    md = (out / "report.md").read_text()
    table = md.split("\n\n")[1].splitlines()
    assert table[0] == "| finding | " + " | ".join(COLUMNS) + " |"
    assert len(table) == 2 + len(rows)


def test_every_cell_has_a_replay_command_that_agrees_with_it(matrix):
    """A present cell's command replays a failure (exit 1), an absent cell's a pass (exit 0), run as written
    from the report's folder."""
    _, out = matrix
    rows = json.loads((out / "report.json").read_text())["findings"]
    row = rows[0]
    ran = {}
    for column in ("ds-0.18.4", "zerostate"):
        cell = row["cells"][column]
        argv = shlex.split(cell["replay"])
        assert argv[:2] == ["zerostate", "replay"] and f"--design {column}" in cell["replay"]
        ran[column] = (cell["status"], _zerostate(*argv[1:], cwd=out).returncode)
    expected = {"present": 1, "absent": 0}
    assert all(code == expected[status] for status, code in ran.values()), ran
    assert ran["zerostate"][0] == "absent"


def test_a_matrix_of_an_unknown_design_is_one_error_line_and_runs_nothing(tmp_path):
    p = _zerostate("explore", "--target", "model", "--design", "ds-0.18.4,no-such-design", "--out",
                   str(tmp_path / "m"))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "no-such-design" in p.stderr
    assert not (tmp_path / "m").exists()
