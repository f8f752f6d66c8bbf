"""The report folder of one run: report.md, report.json, and per finding its scenario, repro script
and pictures.

Each finding is written the moment it arrives (`Report.add_finding`), and
report.md / report.json are rewritten atomically after each one, so an
interrupted run leaves a complete report of everything found so far.  The
format is documented in docs/report-format.md.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import glob
import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from zerostate import __version__
from zerostate.model.events import Event
from zerostate.model.scenario import Scenario

from . import pictures
from .graph_picture import graph_picture
from zerostate.atomic import replace_file
from .report_md import render_markdown

FORMAT = 1
_STALE = ("report.md", "report.json", "repro_*.py", "finding_*.json", "trace_*.svg", "trace_*.png",
          "graph_*.svg", "graph_*.png")
AROUND = 8
"""Events shown before and after the violating one in report.md."""


@dataclass
class FindingRecord:
    """What the report needs of one finding, whatever produced it."""

    check: str
    error: str
    scenario: Scenario
    events: list[Event] | None = None
    violation: int | None = None
    design: str | None = None
    where: str | None = None
    """What produced it, for titles when it is not a model design (``DeepSpeed 0.19.2``)."""
    graph: Any = None
    graph_path: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    repro: Callable[[int], str] | None = None
    """``n ->`` the standalone script ``repro_<n>.py`` (the deepspeed target's ``repro_script``)."""
    key: str | None = None
    """The finding's key (`Finding.key`): what a replay must reproduce to be the same finding."""
    confirmation: dict[str, Any] | None = None
    """explore: the replay in a fresh worker before hand-over (`targets.confirm.Confirmation.to_dict`)."""
    sequence: list[Scenario] = field(default_factory=list)
    """order-dependent findings: the examples to run first, in a fresh worker (replay and repro do)."""


class Report:
    def __init__(self, out_dir: str, command: str, run: dict[str, Any], columns: list[str],
                 specs: dict[str, Any], replay_args: str = ""):
        self.dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        for pattern in _STALE:
            for path in glob.glob(os.path.join(out_dir, pattern)):
                os.unlink(path)
        self._t0 = time.monotonic()
        self.data: dict[str, Any] = {
            "format": FORMAT, "zerostate": __version__, "command": command, "status": "running",
            "run": {**run, "started": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "seconds": 0.0},
            "columns": columns,
            "specs": {sid: {"sentence": s.sentence, "family": s.family,
                            "results": {c: "not checked" for c in columns}, "findings": []}
                      for sid, s in specs.items()},
            "findings": [], "summary": {},
        }
        if command == "explore":
            self.data["reliability"] = _reliability([], [])
        self.replay_args = replay_args
        self.flush()

    # ---------------------------------------------------------------- updates
    def set_result(self, spec_id: str, column: str, result: str, sentence: str = "") -> None:
        row = self.data["specs"].setdefault(spec_id, {"sentence": sentence, "family": "oracle",
                                                      "results": {c: "not checked" for c in
                                                                  self.data["columns"]},
                                                      "findings": []})
        row["results"][column] = result

    def add_finding(self, rec: FindingRecord, column: str | None = None,
                    replay_args: str | None = None, replace: int | None = None) -> dict[str, Any]:
        """Write a finding; ``replace=n`` rewrites finding ``n`` instead (explore hands a finding over
        unshrunk at once, then its shrunk, confirmed scenario under the same number)."""
        with _sigint_deferred():  # Ctrl-C lands after the finding is on disk, never halfway
            return self._add_finding(rec, column, replay_args, replace)

    def _add_finding(self, rec: FindingRecord, column: str | None, replay_args: str | None,
                     replace: int | None = None) -> dict[str, Any]:
        n = replace or len(self.data["findings"]) + 1
        entry: dict[str, Any] = {
            "n": n, "check": rec.check, "error": rec.error, "design": rec.design, "where": rec.where,
            "blocks": len(rec.scenario.blocks), "steps": len(rec.scenario.steps),
            "scenario": rec.scenario.to_dict(), "description": rec.scenario.describe(),
            "violation_event": rec.violation, "events_around": _around(rec.events, rec.violation),
            "files": {}, "notes": list(rec.notes),
        }
        saved: dict[str, Any] = {"check": rec.check, "error": rec.error, "scenario": rec.scenario.to_dict()}
        if rec.key:
            entry["key"] = saved["key"] = rec.key
        if rec.confirmation is not None:
            entry["confirmation"] = dict(rec.confirmation)
            if rec.confirmation.get("status") == "intermittent":  # `zerostate replay` runs it that often
                saved["repeat"] = rec.confirmation.get("repeat")
        if rec.sequence:  # order-dependent: `zerostate replay` runs these first, in a fresh worker
            saved["sequence"] = [sc.to_dict() for sc in rec.sequence]
            entry["sequence"] = [sc.describe() for sc in rec.sequence]
        base = os.path.join(self.dir, f"finding_{n}")
        replace_file(base + ".json", json.dumps(saved, indent=2) + "\n")
        entry["files"]["scenario"] = f"finding_{n}.json"
        replay = f"zerostate replay {os.path.join(self.dir, f'finding_{n}.json')}"
        entry["replay"] = replay + (self.replay_args if replay_args is None else replay_args)
        release = _release_of(rec.design)
        entry["replay_release"] = f"{replay} --deepspeed {release}" if release else None
        self._repro(rec, n, entry)
        self._pictures(rec, n, entry)
        if replace:
            for name in set(self.data["findings"][n - 1]["files"].values()) - set(entry["files"].values()):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, name))
            self.data["findings"][n - 1] = entry
        else:
            self.data["findings"].append(entry)
        self.set_result(rec.check, column or self.data["columns"][0], "violated")
        if n not in self.data["specs"][rec.check]["findings"]:
            self.data["specs"][rec.check]["findings"].append(n)
        if "reliability" in self.data:
            self.data["reliability"] = _reliability(self.data["findings"], self.data["reliability"]["restarts"])
        self.flush()
        return entry

    def add_restart(self, record: dict[str, Any]) -> None:
        """explore: the worker was restarted after example ``record["example"]`` (``record["why"]``)."""
        rel = self.data.setdefault("reliability", _reliability([], []))
        rel["restarts"].append(dict(record))
        self.flush()

    def _repro(self, rec: FindingRecord, n: int, entry: dict[str, Any]) -> None:
        if rec.repro is None:
            entry["notes"].append("no repro script: the deepspeed target's repro generator is not available")
            return
        try:
            script = rec.repro(n)
        except Exception as exc:  # a report must survive a generator bug; say so in it
            entry["notes"].append(f"repro script not generated: {type(exc).__name__}: {exc}")
            return
        replace_file(os.path.join(self.dir, f"repro_{n}.py"), script)
        entry["files"]["repro"] = f"repro_{n}.py"

    def _pictures(self, rec: FindingRecord, n: int, entry: dict[str, Any]) -> None:
        who = f" ({rec.design or rec.where})" if rec.design or rec.where else ""
        if rec.events:
            canvas = pictures.trace_picture(rec.events, rec.violation, f"{rec.check} violated{who}", rec.error)
            for k, name in pictures.write_picture(canvas, os.path.join(self.dir, f"trace_{n}")).items():
                entry["files"][f"trace_{k}"] = name
        if rec.graph is not None:
            canvas = graph_picture(rec.graph, rec.graph_path, f"state graph: {rec.check}{who}",
                                            rec.error)
            for k, name in pictures.write_picture(canvas, os.path.join(self.dir, f"graph_{n}")).items():
                entry["files"][f"graph_{k}"] = name
        if (rec.events or rec.graph is not None) and not any(k.endswith("png") for k in entry["files"]):
            entry["notes"].append("PNG pictures need matplotlib (pip install matplotlib); SVG written")

    def finish(self, status: str = "complete", summary: dict[str, Any] | None = None,
               text: str | None = None) -> None:
        self.data["status"] = status
        if summary is not None:
            self.data["summary"] = summary
        if text is not None:
            self.data["summary_text"] = text
        self.flush()

    def flush(self) -> None:
        self.data["run"]["seconds"] = round(time.monotonic() - self._t0, 2)
        replace_file(os.path.join(self.dir, "report.json"), json.dumps(self.data, indent=2) + "\n")
        replace_file(os.path.join(self.dir, "report.md"), render_markdown(self.data))


def _reliability(findings: list[dict[str, Any]], restarts: list[dict[str, Any]]) -> dict[str, Any]:
    """Findings confirmed by a replay in a fresh worker / reported; order-dependent ones; not reproduced;
    not checked (run interrupted); the worker restarts and why (issue 15)."""
    st = [(f.get("confirmation") or {}).get("status", "not-checked") for f in findings]
    return {"reported": len(findings), "confirmed": st.count("confirmed"),
            "order_dependent": st.count("order-dependent"), "intermittent": st.count("intermittent"),
            "not_reproduced": st.count("not-reproduced"), "not_checked": st.count("not-checked"),
            "restarts": list(restarts)}


def _release_of(design: str | None) -> str | None:
    """``ds-0.18.4`` names the release 0.18.4: its finding can be replayed on that release too."""
    m = re.fullmatch(r"ds-(\d+\.\d+\.\d+)", design or "")
    return m.group(1) if m else None


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) until the block is done, then raise it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _around(events: list[Event] | None, violation: int | None) -> list[dict[str, Any]]:
    if not events:
        return []
    at = violation if violation is not None else len(events) - 1
    lo, hi = max(0, at - AROUND), min(len(events), at + AROUND + 1)
    return [{"index": i, "event": str(events[i]), "violation": i == violation} for i in range(lo, hi)]


__all__ = ["FORMAT", "FindingRecord", "Report"]
