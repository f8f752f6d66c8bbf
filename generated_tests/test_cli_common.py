"""What every subcommand shares, in-process: the argument types and input loading (`cli.common`), the progress
line (`cli.progress`) and the release names ``--deepspeed``, ``bisect`` and the matrix take (`cli.releases`)."""

from __future__ import annotations

import argparse
import io

import pytest

from zerostate.cli import common, progress, releases
from zerostate.cli.common import CliError

RELEASES = ["0.18.4", "0.18.5", "0.18.6", "0.18.7", "0.19.0", "0.19.2", "0.19.3", "0.19.8"]


# ------------------------------------------------------------------ common
def test_argument_types_refuse_what_would_explore_nothing():
    assert common.positive_int("3") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.positive_int(bad)
    assert common.non_negative_float("0") == 0.0 and common.non_negative_float("2.5") == 2.5
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.non_negative_float(bad)


def test_inputs_that_cannot_load_are_one_cli_error_naming_them(tmp_path):
    with pytest.raises(CliError, match="no such scenario file"):
        common.load_scenario(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"blocks": [{"checkpoint": "sometimes"}]}')
    with pytest.raises(CliError, match=r"blocks\[0\]\.checkpoint"):
        common.load_scenario(str(bad))
    with pytest.raises(CliError, match="pr-8130"):  # the error lists the known designs
        common.design("ds-9.9.9")
    with pytest.raises(CliError, match=r"zerostate nothing needs zerostate\.no_such_module"):
        common.need("zerostate.no_such_module", "zerostate nothing")
    with pytest.raises(CliError, match="--world-size 3"):
        common.check_world_size(3)
    common.check_world_size(2)
    assert common.design("zerostate").name == "zerostate"


# ------------------------------------------------------------------ progress
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_line_on_a_terminal_and_erases_it_at_the_end():
    out = _Terminal()
    p = progress.Progress("explore", stream=out, enabled=True)
    p.update(examples=3, findings=1, force=True)
    p.update(examples=4, findings=1)  # within a tenth of a second of the last: not drawn
    assert out.getvalue().startswith("\rexplore: 3 example(s) run, 1 finding(s), ") and out.getvalue().count("\r") == 1
    p.close()
    assert out.getvalue().endswith("\r")


def test_progress_and_notes_say_nothing_in_ci_or_a_pipe(monkeypatch):
    monkeypatch.setenv("CI", "true")
    out = _Terminal()
    assert not progress.interactive(out)
    progress.Progress(stream=out).update(examples=1, force=True)
    progress.note("a note", stream=out)
    assert out.getvalue() == ""
    monkeypatch.delenv("CI")
    progress.note("a note", stream=out)
    assert out.getvalue() == "zerostate: a note\n" and not progress.interactive(io.StringIO())


# ------------------------------------------------------------------ releases
def test_release_ranges_and_unknown_releases_name_their_neighbours():
    assert releases.release_range("0.18.6", "0.19.2", RELEASES) == ["0.18.6", "0.18.7", "0.19.0", "0.19.2"]
    with pytest.raises(CliError, match=r"--from must be an older release"):
        releases.release_range("0.19.2", "0.18.6", RELEASES)
    with pytest.raises(CliError, match=r"--to 0\.19\.1: unknown DeepSpeed release.*nearest: 0\.19\.0, 0\.19\.2"):
        releases.release_range("0.18.6", "0.19.1", RELEASES)
    with pytest.raises(CliError, match="not a DeepSpeed release number"):
        releases.parse("latest", "--deepspeed")
    releases.check_release("0.19.8", "--deepspeed", RELEASES)
