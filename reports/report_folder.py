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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from zerostate import __version__
from zerostate.model.events import Event
from zerostate.findings.finding import Finding

from zerostate.reports import trace_picture as pictures
from zerostate.reports.graph_picture import graph_picture
from zerostate.atomic import replace_file
from zerostate.reports.report_markdown import render_markdown

FORMAT = 1
_STALE = ("report.md", "report.json", "examples.jsonl", "repro_*.py", "finding_*.json", "trace_*.svg", "trace_*.png",
          "graph_*.svg", "graph_*.png")
AROUND = 8
"""Events shown before and after the violating one in report.md."""


@dataclass
class Shown:
    """How a report presents a `Finding` -- nothing of the violation itself, which the report reads from the
    finding: who produced it, the pictures and the repro script to write beside it, notes."""

    design: str | None = None
    """The model design that produced it (check, compare, explore --target model)."""
    where: str | None = None
    """What produced it otherwise, for titles (``DeepSpeed 0.19.2``)."""
    repro: Callable[[int], str] | None = None
    """``n ->`` the standalone script ``repro_<n>.py`` (the deepspeed target's ``repro_script``)."""
    graph: Any = None
    """The counterexample's state graph (check, compare), drawn with ``graph_path`` highlighted."""
    graph_path: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    with_confirmation: bool = True
    """False: handed over before its replay in a fresh worker (explore, unshrunk): no confirmation yet."""


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
                            "results": dict.fromkeys(columns, "not checked"), "findings": []}
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
                                                      "results": dict.fromkeys(self.data["columns"], "not checked"),
                                                      "findings": []})
        row["results"][column] = result

    def add_finding(self, f: Finding, column: str | None = None, replay_args: str | None = None,
                    replace: int | None = None, **shown: Any) -> dict[str, Any]:
        """Write a finding; ``replace=n`` rewrites finding ``n`` instead (explore hands a finding over
        unshrunk at once, then its shrunk, confirmed scenario under the same number).  ``shown``: how
        the report presents it (`Shown`'s fields)."""
        with _sigint_deferred():  # Ctrl-C lands after the finding is on disk, never halfway
            return self._add_finding(f, Shown(**shown), column, replay_args, replace)

    def _add_finding(self, f: Finding, shown: Shown, column: str | None, replay_args: str | None,
                     replace: int | None = None) -> dict[str, Any]:
        n = replace or len(self.data["findings"]) + 1
        assert f.scenario is not None, "a report's findings come from scenarios that ran"
        entry: dict[str, Any] = {
            "n": n, "check": f.check, "error": f.error, "design": shown.design, "where": shown.where,
            "blocks": len(f.scenario.blocks), "steps": len(f.scenario.steps),
            "scenario": f.scenario.to_dict(), "description": f.scenario.describe(),
            "violation_event": f.index, "events_around": _around(f.trace, f.index),
            "files": {}, "notes": list(shown.notes),
        }
        saved: dict[str, Any] = {"check": f.check, "error": f.error, "scenario": f.scenario.to_dict()}
        entry["key"] = saved["key"] = f.key
        conf = f.confirmation if shown.with_confirmation else None
        if conf is not None:
            entry["confirmation"] = conf.to_dict()
            if conf.status == "intermittent":  # `zerostate replay` runs it that often
                saved["repeat"] = conf.repeat
        if conf is not None and conf.sequence:  # order-dependent: `zerostate replay` runs these first
            saved["sequence"] = [sc.to_dict() for sc in conf.sequence]
            entry["sequence"] = [sc.describe() for sc in conf.sequence]
        base = os.path.join(self.dir, f"finding_{n}")
        replace_file(base + ".json", json.dumps(saved, indent=2) + "\n")
        entry["files"]["scenario"] = f"finding_{n}.json"
        replay = f"zerostate replay {os.path.join(self.dir, f'finding_{n}.json')}"
        entry["replay"] = replay + (self.replay_args if replay_args is None else replay_args)
        release = _release_of(shown.design)
        entry["replay_release"] = f"{replay} --deepspeed {release}" if release else None
        self._repro(shown, n, entry)
        self._pictures(f, shown, n, entry)
        if replace:
            for name in set(self.data["findings"][n - 1]["files"].values()) - set(entry["files"].values()):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, name))
            self.data["findings"][n - 1] = entry
        else:
            self.data["findings"].append(entry)
        self.set_result(f.check, column or self.data["columns"][0], "violated")
        if n not in self.data["specs"][f.check]["findings"]:
            self.data["specs"][f.check]["findings"].append(n)
        if "reliability" in self.data:
            self.data["reliability"] = _reliability(self.data["findings"], self.data["reliability"]["restarts"])
        self.flush()
        return entry

    def clear_findings(self) -> None:
        """Forget every finding and delete its files (explore renumbers a complete run's findings)."""
        for entry in self.data["findings"]:
            for name in entry["files"].values():
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, name))
        self.data["findings"] = []
        for row in self.data["specs"].values():
            row["findings"] = []
            row["results"] = {c: ("not checked" if r == "violated" else r) for c, r in row["results"].items()}
        if "reliability" in self.data:
            self.data["reliability"] = _reliability([], self.data["reliability"]["restarts"])

    def add_restart(self, record: dict[str, Any]) -> None:
        """explore: the worker was restarted after example ``record["example"]`` (``record["why"]``)."""
        rel = self.data.setdefault("reliability", _reliability([], []))
        rel["restarts"].append(dict(record))
        self.flush()

    def _repro(self, shown: Shown, n: int, entry: dict[str, Any]) -> None:
        if shown.repro is None:
            entry["notes"].append("no repro script: the deepspeed target's repro generator is not available")
            return
        try:
            script = shown.repro(n)
        except Exception as exc:  # noqa: BLE001 -- a report must survive a generator bug; it says so in it
            entry["notes"].append(f"repro script not generated: {type(exc).__name__}: {exc}")
            return
        replace_file(os.path.join(self.dir, f"repro_{n}.py"), script)
        entry["files"]["repro"] = f"repro_{n}.py"

    def _pictures(self, f: Finding, shown: Shown, n: int, entry: dict[str, Any]) -> None:
        who = f" ({shown.design or shown.where})" if shown.design or shown.where else ""
        if f.trace:
            canvas = pictures.trace_picture(f.trace, f.index, f"{f.check} violated{who}", f.error)
            for k, name in pictures.write_picture(canvas, os.path.join(self.dir, f"trace_{n}")).items():
                entry["files"][f"trace_{k}"] = name
        if shown.graph is not None:
            canvas = graph_picture(shown.graph, shown.graph_path, f"state graph: {f.check}{who}", f.error)
            for k, name in pictures.write_picture(canvas, os.path.join(self.dir, f"graph_{n}")).items():
                entry["files"][f"graph_{k}"] = name
        if (f.trace or shown.graph is not None) and not any(k.endswith("png") for k in entry["files"]):
            entry["notes"].append("PNG pictures need matplotlib (pip install matplotlib); SVG written")

    def finish(self, status: str = "complete", summary: dict[str, Any] | None = None,
               text: str | None = None) -> None:
        self.data["status"] = status
        if summary is not None:
            self.data["summary"] = summary
        if text is not None:
            self.data["summary_text"] = text
        self.flush()

    def write_examples(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """``examples.jsonl``: each generated example's outcome, one JSON object a line, in sequence order -- what
        two runs of the same seed compare example by example (``explorer.explore.GeneratedRun``)."""
        replace_file(os.path.join(self.dir, "examples.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))

    def flush(self) -> None:
        self.data["run"]["seconds"] = round(time.monotonic() - self._t0, 2)
        if any("harness_error" in e for e in self.data["findings"]) or "harness_errors" in self.data:
            self.data["harness_errors"] = [{"n": e["n"], "key": e.get("key"), "why": e["harness_error"]}
                                           for e in self.data["findings"] if e.get("harness_error")]
        replace_file(os.path.join(self.dir, "report.json"), json.dumps(self.data, indent=2) + "\n")
        replace_file(os.path.join(self.dir, "report.md"), render_markdown(self.data))


def _reliability(findings: list[dict[str, Any]], restarts: list[dict[str, Any]]) -> dict[str, Any]:
    """Findings confirmed by a replay in a fresh worker / reported; order-dependent ones; not reproduced;
    not checked (run interrupted); the worker restarts and why."""
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
    """Hold a Ctrl-C (SIGINT) until the block is done, then hand it to the handler the block replaced (which
    raises KeyboardInterrupt; explore's also notes it, so that it is never lost).  Where SIGINT is ignored or
    not handled by Python, or off the main thread, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL, or set outside Python: leave it as it is
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(signal.SIGINT, None)


def _around(events: Sequence[Event] | None, violation: int | None) -> list[dict[str, Any]]:
    if not events:
        return []
    at = violation if violation is not None else len(events) - 1
    lo, hi = max(0, at - AROUND), min(len(events), at + AROUND + 1)
    return [{"index": i, "event": str(events[i]), "violation": i == violation} for i in range(lo, hi)]


__all__ = ["FORMAT", "Report", "Shown"]
