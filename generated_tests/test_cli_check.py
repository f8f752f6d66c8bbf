"""``zerostate check`` run as a subprocess: table, --json keys, report folder, pictures, exit status."""

from __future__ import annotations

import json
import re

import pytest
from test_cli_util import FINDING_KEYS, REPORT_KEYS, assert_pictures, load_report, zs

import zerostate.analysis.checker  # noqa: F401  (a broken import fails, never skips)

SMALL = ("--max-blocks", "2", "--max-micro-steps", "1", "--jobs", "1",
         "--spec", "epilogue-once", "--spec", "count-once-per-phase", "--spec", "clean-step")


@pytest.fixture(scope="module")
def buggy(tmp_path_factory):
    out = tmp_path_factory.mktemp("check")
    r = zs("check", "--design", "ds-0.18.4", "--design", "ds-0.18.7", *SMALL, "--json", "--out", str(out))
    return r, out


def test_json_has_the_documented_keys_and_exit_status_follows_expected_correct(buggy):
    r, _ = buggy
    assert r.returncode == 0, r.stderr  # ds-0.18.7 (expected correct) holds; ds-0.18.4 is known buggy
    data = json.loads(r.stdout)
    assert set(data["designs"]) == {"ds-0.18.4", "ds-0.18.7"}
    for d in data["designs"].values():
        assert {"specs", "states", "seconds"} <= set(d)
        assert d["states"] > 0
        for s in d["specs"].values():
            assert isinstance(s["holds"], bool)
            assert (s["counterexample"] is None) == s["holds"]
    assert not data["designs"]["ds-0.18.4"]["specs"]["epilogue-once"]["holds"]
    assert data["designs"]["ds-0.18.4"]["specs"]["epilogue-once"]["counterexample"]["blocks"]


def test_report_folder_holds_a_finding_per_counterexample_with_pictures(buggy):
    _, out = buggy
    rep = load_report(out)
    assert set(rep) >= REPORT_KEYS and rep["status"] == "complete" and rep["command"] == "check"
    assert rep["columns"] == ["ds-0.18.4", "ds-0.18.7"]
    assert rep["specs"]["epilogue-once"]["results"] == {"ds-0.18.4": "violated", "ds-0.18.7": "holds"}
    assert rep["findings"], "ds-0.18.4 has counterexamples at this bound"
    for f in rep["findings"]:
        assert set(f) >= FINDING_KEYS
        assert f["design"] == "ds-0.18.4"
        assert (out / f["files"]["scenario"]).exists()
        assert "--target model --design ds-0.18.4" in f["replay"]
        assert f["replay_release"].endswith(f"{f['files']['scenario']} --deepspeed 0.18.4")
        assert_pictures(out, f, "trace")
        assert_pictures(out, f, "graph")
        assert any(e["violation"] for e in f["events_around"]) or f["violation_event"] is None
        # the finding's key is its fingerprint: spec, the monitor's code, the violating event's kind, phase and
        # task, the roles of what it touches (findings/fingerprint.py) -- never a shape of its message
        assert re.fullmatch(re.escape(f["check"]) + r":[a-z0-9-]+(@[a-z_]+/[a-z_-]+/(outer|nested|backward|none)"
                            r"(:[a-z,]+)?|@end)", f["key"]), f["key"]
        assert json.loads((out / f["files"]["scenario"]).read_text())["key"] == f["key"]
    md = (out / "report.md").read_text()
    assert "| `epilogue-once` | **violated** | holds |" in md
    assert "### Finding 1: `epilogue-once` on `ds-0.18.4`" in md and "zerostate replay" in md


def test_table_names_every_design_and_spec(tmp_path):
    r = zs("check", "--design", "ds-0.18.5", *SMALL, "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["design", "expected"] and "count-once-per-phase" in lines[0]
    row = next(line for line in lines if line.startswith("ds-0.18.5"))
    assert "VIOLATED" in row and "buggy" in row  # ds-0.18.5 counts in every hook (seed 000 part 2)
    assert "states" in lines[0] and "seconds" in lines[0]


def test_unknown_design_lists_the_known_ones(tmp_path):
    r = zs("check", "--design", "ds-9.9.9", "--out", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "unknown design 'ds-9.9.9'" in r.stderr
    assert "ds-0.18.7" in r.stderr and "zerostate" in r.stderr
    assert not (tmp_path / "report.json").exists()


def test_unknown_spec_lists_the_known_ones(tmp_path):
    r = zs("check", "--spec", "be-nice", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--spec be-nice" in r.stderr and "epilogue-once" in r.stderr


def test_pictures_mark_the_violation_and_png_matches_svg(buggy):
    import xml.etree.ElementTree as ET
    _, out = buggy
    f = load_report(out)["findings"][0]
    svg = (out / f["files"]["trace_svg"]).read_text()
    assert 'stroke="#d50000"' in svg and ">violation<" in svg  # the violating event, ringed and lined in red
    for lane in ("engine", "blocks.0.lin", "blocks.1.lin"):
        assert f">{lane}</text>" in svg
    assert ">backward</text>" in svg  # a shaded phase, labelled
    import PIL  # noqa: F401  (a dependency: PNGs are always written)
    from test_cli_util import assert_png
    root = ET.fromstring(svg)
    assert assert_png(out / f["files"]["trace_png"]) == (int(root.get("width")), int(root.get("height")))


def test_an_unknown_spec_or_design_is_refused_before_the_check_runs(tmp_path):
    """`cli.cmd_check` in-process (the tests above run the installed command)."""
    from zerostate.cli import cmd_check
    from zerostate.cli.common import CliError
    from zerostate.cli.main import parser
    for argv, needle in ((["--spec", "no-such-spec"], "known specs: "), (["--design", "ds-9.9"], "unknown design")):
        args = parser().parse_args(["check", *argv, "--out", str(tmp_path / "r")])
        with pytest.raises(CliError, match=needle):
            cmd_check.run(args)
    assert not (tmp_path / "r").exists()


def test_the_table_has_a_row_per_design_and_a_column_per_spec(buggy):
    from types import SimpleNamespace

    from zerostate.cli import cmd_check
    data = json.loads(buggy[0].stdout)
    designs = {n: SimpleNamespace(checked=tuple(d["specs"]), judged=tuple(d["specs"]), states=d["states"],
                                  seconds=d["seconds"], expected_correct=n == "ds-0.18.7",
                                  holds=lambda s, d=d: d["specs"][s]["holds"])
               for n, d in data["designs"].items()}
    lines = cmd_check.table(SimpleNamespace(designs=designs)).splitlines()
    assert lines[0].split()[:3] == ["design", "expected", "epilogue-once"] and len(lines) == 2 + len(designs)
    row = next(ln for ln in lines if ln.startswith("ds-0.18.4"))
    assert "buggy" in row and "VIOLATED" in row
