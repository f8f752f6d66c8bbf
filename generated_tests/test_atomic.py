"""`zerostate.atomic.replace_file`: the report files a reader may open while a run rewrites them."""

from __future__ import annotations

import os
import stat

import pytest

from zerostate.atomic import replace_file


def test_replace_file_leaves_the_new_text_and_no_temporary_file(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    replace_file(str(path), "new\n")
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["report.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask  # as open() would have made it


def test_a_write_that_fails_keeps_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "report.md"
    path.write_text("old")

    def refuse(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        replace_file(str(path), "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["report.md"]
