"""Helpers for the CLI tests: run the real ``zerostate`` command, validate SVG and PNG files.

(No tests here; the name keeps it beside the tests it serves.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

from zerostate.targets.interface import Target

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent / "zerostate"


def zs(*args: str, timeout: float = 300, env: dict | None = None, cwd: str | None = None,
       ) -> subprocess.CompletedProcess:
    """Run the installed console script (``python -m zerostate.cli.main`` if there is none)."""
    cmd = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "zerostate.cli.main"]
    full_env = {**os.environ, "CI": "true", **(env or {})}
    return run_group(cmd + list(args), timeout=timeout, env=full_env, cwd=cwd)


def run_group(cmd: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own: on ``timeout`` the whole
    process group is killed (the command's workers, ranks and watched job too, not only the command: an orphan
    keeps a core busy, or a JIT build lock held, for the rest of the run), then TimeoutExpired is raised.  What a
    command that ended left behind is left alone: tests look for it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def load_report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


REPORT_KEYS = {"format", "zerostate", "command", "status", "run", "columns", "specs", "findings", "summary"}
FINDING_KEYS = {"n", "check", "error", "design", "where", "blocks", "steps", "scenario", "description",
                "violation_event", "events_around", "files", "replay", "replay_release", "notes"}


def assert_svg(path: Path) -> None:
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg", root.tag
    assert float(root.get("width")) > 100 and float(root.get("height")) > 100
    assert len(list(root)) > 10, "an SVG with almost nothing drawn"


def has_pillow() -> bool:
    import importlib.util
    return importlib.util.find_spec("PIL") is not None


def assert_pictures(folder: Path, finding: dict, which: str = "trace") -> None:
    """``<which>_<n>.svg`` always; ``.png`` too where Pillow is installed (else the finding says why)."""
    assert_svg(folder / finding["files"][f"{which}_svg"])
    if has_pillow():
        assert_png(folder / finding["files"][f"{which}_png"])
    else:
        assert any("Pillow" in note for note in finding["notes"]), finding["notes"]


def assert_png(path: Path) -> tuple[int, int]:
    """Walk the chunks (CRCs checked), inflate the image data; return (width, height)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, f"bad CRC in {kind!r}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
        if kind == b"IEND":
            break
    assert size and size[0] > 100 and size[1] > 100, size
    raw = zlib.decompress(idat)
    assert len(raw) >= size[1] * (size[0] + 1), "truncated image data"
    return size


class FailingTarget(Target):
    """The model target until its ``after``-th run, then the error a deepspeed target raises when its world-size-2
    rank pool cannot start (``TargetError``, several lines: the reason, then the pool's log)."""

    def __init__(self, after: int, design: str = "ds-0.18.4"):
        from zerostate.targets.interface import get_target
        self.inner = get_target("model", design=design)
        self.name, self.version, self.design = "model", None, self.inner.design
        self.after, self.n = after, 0

    def run(self, sc):
        from zerostate.targets.interface import TargetError
        self.n += 1
        if self.n > self.after:
            raise TargetError("the DeepSpeed rank pool (2 ranks) did not start (rank 1 exited (code 1)):\n"
                              "Traceback (most recent call last):\n  File \"rank_worker.py\", line 1\nImportError: x")
        return self.inner.run(sc)


def assert_one_line_error(rc: int, err: str, *words: str) -> None:
    """Exit 2 and one line on stderr, ``zerostate: ...``, naming the problem: never a traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("zerostate: "), (rc, err)
    assert "Traceback" not in err and all(w in lines[0] for w in words), err
