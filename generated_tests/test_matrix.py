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
def design_matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("matrix")
    p = _zerostate("explore", "--target", "model", "--design", ",".join(COLUMNS), "--examples", "10",
                   "--out", str(out))
    return p, out


def test_one_report_has_a_cell_per_finding_and_column(design_matrix):
    p, out = design_matrix
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


def test_every_cell_has_a_replay_command_that_agrees_with_it(design_matrix):
    """A present cell's command replays a failure (exit 1), an absent cell's a pass (exit 0), run as written
    from the report's folder."""
    _, out = design_matrix
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


# ------------------------------------------------------------------ the matrix's parts, in-process
def test_the_columns_a_matrix_asks_for_and_a_list_naming_one_twice():
    """`cli.matrix.columns` / `requested`: a list of designs or releases is a matrix, one name is not."""
    from argparse import Namespace

    from zerostate.cli.common import CliError
    from zerostate.cli.matrix import columns, requested
    from zerostate.reports.matrix_model import Column
    model = Namespace(target="model", design="ds-0.18.4, zerostate", deepspeed=None)
    assert columns(model) == [Column("ds-0.18.4", "model"), Column("zerostate", "model")]
    assert columns(Namespace(target="model", design="zerostate", deepspeed=None)) is None
    assert columns(Namespace(target="deepspeed", design=None, deepspeed="0.19.2,0.19.8")) == [
        Column("0.19.2", "deepspeed"), Column("0.19.8", "deepspeed")]
    assert requested("0.19.8") is None
    with pytest.raises(CliError, match="named twice"):
        requested("0.19.2,0.19.2")
    assert Column("0.19.2", "deepspeed").options(2) == {"deepspeed": "0.19.2", "world_size": 2}
    assert Column("zerostate", "model").replay_args() == " --target model --design zerostate"


def test_rows_cells_by_replay_and_the_report_in_process(tmp_path):
    """`reports.matrix_cells` (rows from the explorations, the empty cells by replay), `reports.matrix_model`
    and `reports.matrix_report`, on two model designs: a ds-0.18.4 finding is present there by exploration,
    absent on the fixed design by replay."""
    from zerostate.explorer.generate import generated
    from zerostate.explorer.strategies import scenarios
    from zerostate.reports.matrix_cells import cell_of, replay_cells, rows_of
    from zerostate.reports.matrix_model import Column, ColumnExploration, FoundFinding, MatrixReport, MatrixRun
    from zerostate.reports.matrix_report import write
    from zerostate.targets.interface import get_target
    buggy = get_target("model", design="ds-0.18.4")
    out = next(o for o in map(buggy.run, generated(scenarios(setup=False), 40, None)) if o.findings)
    f = out.findings[0]
    assert cell_of(out, f.key) == ("present", "") and cell_of(out, "no-such-key")[0] in ("absent", "crashed before")
    cols = [Column("ds-0.18.4", "model"), Column("zerostate", "model")]
    found = FoundFinding(1, f.key, f.check, f.error, None, f.scenario.to_dict())
    explored = {"ds-0.18.4": ColumnExploration("ds-0.18.4", "complete", "ds-0.18.4", str(tmp_path / "a"), 1,
                                               examples=40, findings=(found,)),
                "zerostate": ColumnExploration("zerostate", "complete", "zerostate", str(tmp_path / "b"), 0,
                                               examples=40)}
    rows = rows_of(cols, explored)
    assert [(r.n, r.key, set(r.cells)) for r in rows] == [(1, f.key, {"ds-0.18.4"})]
    rows = replay_cells(rows, cols, explored, tmp_path, lambda c: get_target("model", design=c.name), False)
    cell = rows[0].cells["zerostate"]
    assert (cell.status, cell.by, cell.link) == ("absent", "replay", "replays/1-zerostate.json")
    assert json.loads((tmp_path / cell.link).read_text())["status"] == "absent"
    report = MatrixReport("complete", ("ds-0.18.4", "zerostate"), "model", explored,
                          MatrixRun(40, None, 1, None, False, 1.0, "zerostate explore"), tuple(rows))
    write(tmp_path, report)
    assert json.loads((tmp_path / "report.json").read_text())["findings"][0]["cells"]["zerostate"]["by"] == "replay"
    md = (tmp_path / "report.md").read_text()
    assert f"| #1 `{f.key}` | [**present**](ds-0.18.4/finding_1.json) | [absent](replays/1-zerostate.json) |" in md
