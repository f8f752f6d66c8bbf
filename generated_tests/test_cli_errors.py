"""Bad input: exit status 2, one line on stderr naming the problem, and no half-written report."""

from __future__ import annotations

import json

import pytest
from test_cli_util import zs


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("zerostate: ") and r.stderr.count("\n") == 1, r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


@pytest.mark.parametrize("content, needles", [
    ("{not json", ["not valid JSON"]),
    (json.dumps({"blocks": [{"checkpoint": "sometimes"}]}), ["blocks[0].checkpoint", "'reentrant'"]),
    (json.dumps({"blocks": [{}], "stage": 4}), ["stage", "1, 2 or 3"]),
    (json.dumps({"blocks": [], "steps": [{}]}), ["blocks"]),
    (json.dumps({"check": "epilogue-once", "scenario": {"steps": [{"micro": [{"backward": "sideways"}]}]}}),
     ["steps[0].micro[0].backward"]),
    (json.dumps({"blocks": [{"colour": "red"}]}), ["blocks[0]", "colour"]),
])
def test_malformed_scenario_names_file_and_field(tmp_path, content, needles):
    path = tmp_path / "bad.json"
    path.write_text(content)
    for cmd in (["replay", str(path)], ["bisect", str(path), "--from", "0.18.4", "--to", "0.18.6"]):
        _one_line_error(zs(*cmd), str(path), *needles)


def test_missing_scenario_file(tmp_path):
    _one_line_error(zs("replay", str(tmp_path / "nope.json")), "nope.json", "no such scenario file")


def test_world_size_three_is_not_supported(tmp_path):
    _one_line_error(zs("explore", "--world-size", "3", "--out", str(tmp_path)), "--world-size 3")
    assert not (tmp_path / "report.json").exists()


def test_deepspeed_path_that_is_not_a_folder(tmp_path):
    _one_line_error(zs("explore", "--deepspeed-path", str(tmp_path / "DeepSpeed"), "--out", str(tmp_path)),
                    "--deepspeed-path", "DeepSpeed checkout")


def test_options_that_do_not_fit_together(tmp_path):
    _one_line_error(zs("explore", "--deepspeed", "0.18.4", "--deepspeed-path", str(tmp_path)), "not both")
    _one_line_error(zs("explore", "--examples", "0"), "--examples", "at least 1, got 0")


@pytest.mark.parametrize("args, needles", [
    (["check", "--max-blocks", "0"], ["--max-blocks", "at least 1, got 0"]),
    (["check", "--max-micro-steps", "0"], ["--max-micro-steps", "at least 1, got 0"]),
    (["check", "--jobs", "0"], ["--jobs", "at least 1, got 0"]),
    (["check", "--max-blocks", "two"], ["--max-blocks", "expected an integer"]),
    (["compare", "ds-0.19.3", "zerostate", "--max-blocks", "0"], ["--max-blocks", "at least 1"]),
    (["explore", "--time-budget", "-1"], ["--time-budget", ">= 0, got -1"]),
    (["explore", "--time-budget", "nan"], ["--time-budget", ">= 0"]),
])
def test_bounds_that_would_explore_nothing_are_refused(tmp_path, args, needles):
    """A bound of 0 once explored 0 states and reported the buggy ds-0.18.4 as holding every spec, exit 0."""
    _one_line_error(zs(*args, "--out", str(tmp_path)), *needles)
    assert not (tmp_path / "report.json").exists()


def test_unknown_option_and_command_are_one_line():
    _one_line_error(zs("explore", "--frobnicate"), "--frobnicate")
    _one_line_error(zs("frobnicate"), "frobnicate")


def test_bisect_range_must_be_releases_in_order(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("{}")
    _one_line_error(zs("bisect", str(path), "--from", "0.19.8", "--to", "0.18.4"), "older release")
    _one_line_error(zs("bisect", str(path), "--from", "banana", "--to", "0.18.4"), "not a DeepSpeed release")


def test_bisect_unknown_release_says_what_exists(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("{}")
    r = zs("bisect", str(path), "--from", "0.18.4", "--to", "0.18.99")
    if "cannot list DeepSpeed releases" in r.stderr:
        pytest.skip("package index not reachable")
    _one_line_error(r, "--to 0.18.99", "unknown DeepSpeed release", "0.18.9")


def test_unknown_deepspeed_release_is_named(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("{}")
    r = zs("replay", str(path), "--deepspeed", "0.18.99")
    if "cannot list DeepSpeed releases" in r.stderr:
        pytest.skip("package index not reachable")
    _one_line_error(r, "--deepspeed 0.18.99", "unknown DeepSpeed release")
    _one_line_error(zs("replay", str(path), "--deepspeed", "latest"), "not a DeepSpeed release number")


def test_watch_without_a_runnable_command_is_a_cli_error_before_anything_starts(tmp_path):
    """`cli.cmd_watch` in-process: no command, or one that does not exist, is refused before any job or report."""
    from zerostate.cli import cmd_watch
    from zerostate.cli.common import CliError
    from zerostate.cli.main import parser
    for job, needle in (([], "no command given"), (["--"], "no command given"),
                        (["--", str(tmp_path / "no-such-job")], "command not found")):
        args = parser().parse_args(["watch", "--out", str(tmp_path / "r"), *job])
        assert args.run is cmd_watch.run
        with pytest.raises(CliError, match=needle):
            cmd_watch.run(args)
    assert not (tmp_path / "r").exists()
