"""Run ``zerostate explore`` on a DeepSpeed tree as a user would, watching its report for new findings, and
replay one finding file on a tree.

The report (``report.json``) is rewritten whole the moment a finding is handed over, unshrunk, and its
``run.seconds`` is the time since the exploration started at that write; polling it every half second gives
each finding's time to first appearance (to the resolution of one report write) without touching the
explorer.  ``stop_when`` ends the run early (SIGINT, as Ctrl-C: the report keeps what it has) once the
findings seen so far settle the question.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from faults.verdict import SeenFinding, seen_in

ZEROSTATE = str(Path(sys.executable).with_name("zerostate"))
POLL_S = 0.5


@dataclass
class ExploreRun:
    report: dict[str, Any]
    seen: list[SeenFinding]
    wall_s: float
    stopped_early: bool
    returncode: int | None
    cut: bool = False
    """Ended by ``cut_s`` with nothing settled: what it saw is all it saw."""


def explore_args(tree: Path, out: Path, examples: int | None, seed: int | None) -> list[str]:
    args = [ZEROSTATE, "explore", "--deepspeed-path", str(tree), "--out", str(out)]
    if examples is not None:
        args += ["--examples", str(examples)]
    if seed is not None:
        args += ["--seed", str(seed)]
    return args


def _read(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _restore_sigint() -> None:
    """In the child: Ctrl-C's default, even when this benchmark runs as a background job (SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def explore(tree: Path, out: Path, log: Path, examples: int | None, seed: int | None,
            stop_when: Callable[[list[SeenFinding]], bool] | None = None, timeout_s: float = 7200.0,
            cut_s: float | None = None) -> ExploreRun:
    """One exploration of ``tree`` into ``out``; ``stop_when(seen)`` true ends it early, and so does
    ``cut_s`` seconds of exploring (from the report's first write)."""
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "report.json"
    if report_path.exists():
        report_path.unlink()
    t0 = time.monotonic()
    seen: dict[str, SeenFinding] = {}
    stopped = cut = False
    t_report: float | None = None
    with open(log, "w") as fh:
        proc = subprocess.Popen(explore_args(tree, out, examples, seed), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=_restore_sigint)  # noqa: PLW1509 - this benchmark starts no threads
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                report = _read(report_path)
                if report is not None:
                    seen = seen_in(report, seen)
                    t_report = t_report or time.monotonic()
                if not stopped and stop_when is not None and stop_when(list(seen.values())):
                    stopped = True
                    proc.send_signal(signal.SIGINT)
                    _wait_or_kill(proc, 120.0)
                elif not stopped and cut_s is not None and t_report and time.monotonic() - t_report > cut_s:
                    stopped = cut = True
                    proc.send_signal(signal.SIGINT)
                    _wait_or_kill(proc, 120.0)
                if time.monotonic() - t0 > timeout_s:
                    stopped = True
                    _wait_or_kill(proc, 0.0)
        finally:
            if proc.poll() is None:
                _wait_or_kill(proc, 0.0)
    report = _read(report_path) or {}
    seen = seen_in(report, seen)
    return ExploreRun(report, list(seen.values()), time.monotonic() - t0, stopped, proc.returncode, cut)


def _wait_or_kill(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Wait ``grace_s`` for ``proc`` to end, then kill its process group (its workers are in it)."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    else:
        try:  # workers the run left behind in its session
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def replay(finding_file: Path, tree: Path, log: Path, timeout_s: float = 900.0) -> dict[str, Any]:
    """Replay a ``finding_<n>.json`` on ``tree`` in a fresh worker (its own process): ``zerostate replay
    --json``'s answer (``passed``, ``check``, ``same_key``, ...), or ``{"error": ...}``."""
    args = [ZEROSTATE, "replay", "--deepspeed-path", str(tree), "--json", str(finding_file)]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"error": f"replay did not finish in {timeout_s:.0f} s"}
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    try:
        answer = json.loads(proc.stdout)
        return answer if isinstance(answer, dict) else {"error": "replay printed no JSON object"}
    except ValueError:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}


__all__ = ["ExploreRun", "ZEROSTATE", "explore", "explore_args", "replay"]
