"""``zerostate compare A B`` as a subprocess: side-by-side table, --json keys, report with findings."""

from __future__ import annotations

import json
import re

import pytest
from test_cli_util import assert_pictures, load_report, zs

import zerostate.analysis.design_comparison  # noqa: F401  (a broken import fails, never skips)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    r = zs("compare", "ds-0.19.3", "pr-8130", "--max-blocks", "1", "--json", "--out", str(out))
    return r, out


def test_json_has_both_designs_and_the_metrics(compared):
    r, _ = compared
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["designs"] == ["ds-0.19.3", "pr-8130"] and data["scenarios"] > 0
    assert {"specs", "gathered_peak", "allgathers", "per_scenario"} <= set(data)
    for row in data["specs"].values():
        assert isinstance(row["ds-0.19.3"]["holds"], bool) and isinstance(row["pr-8130"]["holds"], bool)


def test_report_has_a_column_per_design_and_a_finding_per_violation(compared):
    r, out = compared
    data, rep = json.loads(r.stdout), load_report(out)
    assert rep["command"] == "compare" and rep["columns"] == ["ds-0.19.3", "pr-8130"]
    violated = {(sid, d) for sid, row in data["specs"].items() for d in data["designs"] if not row[d]["holds"]}
    assert {(f["check"], f["design"]) for f in rep["findings"]} == violated
    for f in rep["findings"]:
        assert_pictures(out, f, "trace")
        # its fingerprint (`findings.fingerprint.spec_fingerprint`): check:code, the violating event's kind, phase and
        # where (or @end: an obligation open at the end), the distinguishing roles of the parameters involved
        m = re.fullmatch(re.escape(f["check"]) + r":[a-z0-9-]+@(?:end|([a-z_]+)/[^/]+/(?:outer|nested|backward|none))"
                         r"(?::(?:adapter|frozen|leaf|persistent)(?:,(?:adapter|frozen|leaf|persistent))*)?", f["key"])
        assert m, f["key"]
        assert f["violation_event"] is None or any(e["violation"] for e in f["events_around"])
        if f["violation_event"] is not None:  # the key names the very event the report marks
            (marked,) = [e for e in f["events_around"] if e["index"] == f["violation_event"]]
            assert marked["violation"] and marked["event"].split()[0] == m.group(1), (f["key"], marked)
        else:
            assert m.group(1) is None, f["key"]
    md = (out / "report.md").read_text()
    assert "## Summary" in md and "gathered-peak" in md


def test_text_table_and_unknown_design(tmp_path):
    r = zs("compare", "ds-0.19.3", "pr-8130", "--max-blocks", "1", "--out", str(tmp_path))
    assert r.returncode == 0 and r.stdout.startswith("ds-0.19.3 vs pr-8130 over")
    r = zs("compare", "ds-0.19.3", "pr-9999", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "unknown design 'pr-9999'" in r.stderr and "pr-8130" in r.stderr
    assert not (tmp_path / "x").exists()


def test_compare_in_process_files_a_finding_per_violation(tmp_path, capsys):
    """`cli.cmd_compare` in-process, on the smallest networks: the same report as the command's."""
    from zerostate.cli import cmd_compare
    from zerostate.cli.main import parser
    args = parser().parse_args(["compare", "ds-0.19.2", "zerostate", "--max-blocks", "1", "--json",
                                "--out", str(tmp_path)])
    assert cmd_compare.run(args) == 0
    data, rep = json.loads(capsys.readouterr().out), load_report(tmp_path)
    violated = {(sid, d) for sid, row in data["specs"].items() for d in data["designs"] if not row[d]["holds"]}
    assert violated and {(f["check"], f["design"]) for f in rep["findings"]} == violated
    assert all(d == "ds-0.19.2" for _, d in violated), "the fixed design holds; seed 002 breaks 0.19.2's"
