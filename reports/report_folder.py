"""The report folder of one run: report.md, report.json, and per finding its scenario, repro script
and pictures.

`Report` builds the run's `RunReport` as the run goes: each finding is written the moment it arrives
(`Report.add_finding`), and report.md / report.json are rewritten atomically after each one, so an
interrupted run leaves a complete report of everything found so far.  The format is documented in
docs/report-format.md.
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace as _replace
from typing import Any, Protocol

from zerostate import __version__
from zerostate.model.events import Event
from zerostate.findings.finding import Finding

from zerostate.atomic import replace_file
from zerostate.reports import trace_picture as pictures
from zerostate.reports.finding_entry import AroundEvent, Confirmation, FindingEntry, Labels
from zerostate.reports.graph_picture import graph_picture
from zerostate.reports.json_value import Json, JsonObject
from zerostate.reports.report_markdown import render_markdown
from zerostate.reports.run_report import NOT_CHECKED, HarnessError, Reliability, WhatRan, RunReport, SpecRow

_STALE = ("report.md", "report.json", "examples.jsonl", "repro_*.py", "finding_*.json", "trace_*.svg", "trace_*.png",
          "graph_*.svg", "graph_*.png")
AROUND = 8
"""Events shown before and after the violating one in report.md."""


class Described(Protocol):
    """A spec as a report lists it (`specs.base.Spec`)."""

    @property
    def sentence(self) -> str: ...
    @property
    def family(self) -> str: ...


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
    """The counterexample's state graph (a networkx graph: check, compare), drawn with ``graph_path``
    highlighted."""
    graph_path: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    with_confirmation: bool = True
    """False: handed over before its replay in a fresh worker (explore, unshrunk): no confirmation yet."""


class Report:
    """The report folder of one run, and the `RunReport` it holds so far (`model`)."""

    def __init__(self, out_dir: str, command: str, run: JsonObject, columns: Sequence[str],
                 specs: Mapping[str, Described], replay_args: str = ""):
        self.dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        for pattern in _STALE:
            for path in glob.glob(os.path.join(out_dir, pattern)):
                os.unlink(path)
        self._t0 = time.monotonic()
        self._png_kept: dict[str, bytes] = {}
        """Each picture's PNG by its SVG text: a finding written again with the same picture (explore renumbers
        its findings at the end) copies it instead of rasterising it again."""
        self.model = RunReport(
            __version__, command, "running",
            WhatRan(dict(run), _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")),
            tuple(columns),
            {sid: SpecRow(s.sentence, s.family, dict.fromkeys(columns, NOT_CHECKED)) for sid, s in specs.items()},
            (), {}, reliability=Reliability() if command == "explore" else None)
        """What the report holds so far (report.json is its serialisation)."""
        self.replay_args = replay_args
        self.flush()

    # ---------------------------------------------------------------- updates
    def _update(self, **changes: Any) -> None:
        self.model = _replace(self.model, **changes)

    def set_result(self, spec_id: str, column: str, result: str, sentence: str = "") -> None:
        specs = dict(self.model.specs)
        row = specs.get(spec_id) or SpecRow(sentence, "oracle", dict.fromkeys(self.model.columns, NOT_CHECKED))
        specs[spec_id] = _replace(row, results={**row.results, column: result})
        self._update(specs=specs)

    def set_examples_run(self, n: int) -> None:
        """explore: distinct runs so far (written with the next flush)."""
        self._update(run=_replace(self.model.run, examples_run=n))

    def set_stopped(self, why: str) -> None:
        """The run stopped before its budget was spent, and why (written with the next flush)."""
        self._update(run=_replace(self.model.run, stopped=why))

    def count_harness_errors(self) -> None:
        """List zerostate's own failures apart (``harness_errors``), none so far: the deepspeed target's runs."""
        if self.model.harness_errors is None:
            self._update(harness_errors=())

    def set_cluster_retries(self, retries: Sequence[JsonObject]) -> None:
        """The lanes a cluster ran again (a worker or its node lost), as the cluster recorded them."""
        rel = self.model.reliability or Reliability()
        self._update(reliability=_replace(rel, cluster_retries=tuple(retries)))

    def set_pairs(self, pairs: Json) -> None:
        self._update(pairs=pairs)

    def set_steering(self, steering: Json) -> None:
        self._update(steering=steering)

    def add_finding(self, f: Finding, column: str | None = None, replay_args: str | None = None,
                    replace: int | None = None, *, shrunk: bool | None = None, stage: str | None = None,
                    labels: Labels | None = None, **shown: Any) -> FindingEntry:
        """Write a finding; ``replace=n`` rewrites finding ``n`` instead (explore hands a finding over
        unshrunk at once, then its shrunk, confirmed scenario under the same number).  ``shrunk``, ``stage``:
        explore's (`FindingEntry`); ``labels``: a real DeepSpeed finding's known issue and root-cause group;
        ``shown``: how the report presents it (`Shown`'s fields)."""
        with _sigint_deferred():  # Ctrl-C lands after the finding is on disk, never halfway
            return self._add_finding(f, Shown(**shown), column, replay_args, replace, shrunk, stage, labels)

    def _add_finding(self, f: Finding, shown: Shown, column: str | None, replay_args: str | None,
                     replace: int | None, shrunk: bool | None, stage: str | None,
                     labels: Labels | None) -> FindingEntry:
        findings = list(self.model.findings)
        n = replace or len(findings) + 1
        assert f.scenario is not None, "a report's findings come from scenarios that ran"
        saved: dict[str, Json] = {"check": f.check, "error": f.error, "scenario": f.scenario.to_dict(), "key": f.key}
        conf = f.confirmation if shown.with_confirmation else None
        confirmation = None
        if conf is not None:
            record = conf.to_dict()
            confirmation = Confirmation(conf.status, conf.repeat, record.get("hits"), record)
            if conf.status == "intermittent":  # `zerostate replay` runs it that often
                saved["repeat"] = conf.repeat
        if conf is not None and conf.sequence:  # order-dependent: `zerostate replay` runs these first
            saved["sequence"] = [sc.to_dict() for sc in conf.sequence]
        replace_file(os.path.join(self.dir, f"finding_{n}.json"), json.dumps(saved, indent=2) + "\n")
        files = {"scenario": f"finding_{n}.json"}
        notes = list(shown.notes)
        self._repro(shown, n, files, notes)
        self._pictures(f, shown, n, files, notes)
        replay = f"zerostate replay {os.path.join(self.dir, f'finding_{n}.json')}"
        release = _release_of(shown.design)
        entry = FindingEntry(
            n, f.check, f.error, shown.design, shown.where, len(f.scenario.blocks), len(f.scenario.steps),
            f.scenario.to_dict(), f.scenario.describe(), f.index, _around(f.trace, f.index), files, tuple(notes),
            f.key, replay + (self.replay_args if replay_args is None else replay_args),
            f"{replay} --deepspeed {release}" if release else None, confirmation,
            tuple(sc.describe() for sc in conf.sequence) if conf is not None else (), shrunk, stage, labels)
        if replace:
            for name in set(findings[n - 1].files.values()) - set(entry.files.values()):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, name))
            findings[n - 1] = entry
        else:
            findings.append(entry)
        self._update(findings=tuple(findings))
        self.set_result(f.check, column or self.model.columns[0], "violated")
        row = self.model.specs[f.check]
        if n not in row.findings:
            self._update(specs={**self.model.specs, f.check: _replace(row, findings=(*row.findings, n))})
        if self.model.reliability is not None:
            self._reliability()
        self.flush()
        return entry

    def _reliability(self) -> None:
        rel = self.model.reliability or Reliability()
        self._update(reliability=Reliability.of(self.model.findings, rel.restarts, rel.cluster_retries))

    def clear_findings(self) -> None:
        """Forget every finding and delete its files (explore renumbers a complete run's findings)."""
        for entry in self.model.findings:
            for name in entry.files.values():
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, name))
        specs = {sid: _replace(row, findings=(), results={c: (NOT_CHECKED if r == "violated" else r)
                                                          for c, r in row.results.items()})
                 for sid, row in self.model.specs.items()}
        self._update(findings=(), specs=specs)
        if self.model.reliability is not None:
            self._reliability()

    def add_restart(self, record: JsonObject) -> None:
        """explore: the worker was restarted after example ``record["example"]`` (``record["why"]``)."""
        rel = self.model.reliability or Reliability()
        self._update(reliability=_replace(rel, restarts=(*rel.restarts, dict(record))))
        self.flush()

    def _repro(self, shown: Shown, n: int, files: dict[str, str], notes: list[str]) -> None:
        if shown.repro is None:
            notes.append("no repro script: the deepspeed target's repro generator is not available")
            return
        try:
            script = shown.repro(n)
        except Exception as exc:  # noqa: BLE001 -- a report must survive a generator bug; it says so in it
            notes.append(f"repro script not generated: {type(exc).__name__}: {exc}")
            return
        replace_file(os.path.join(self.dir, f"repro_{n}.py"), script)
        files["repro"] = f"repro_{n}.py"

    def _pictures(self, f: Finding, shown: Shown, n: int, files: dict[str, str], notes: list[str]) -> None:
        produced_by = f" ({shown.design or shown.where})" if shown.design or shown.where else ""
        if f.trace:
            canvas = pictures.trace_picture(f.trace, f.index, f"{f.check} violated{produced_by}", f.error)
            base = os.path.join(self.dir, f"trace_{n}")
            for k, name in pictures.write_picture(canvas, base, self._png_kept).items():
                files[f"trace_{k}"] = name
        if shown.graph is not None:
            canvas = graph_picture(shown.graph, shown.graph_path, f"state graph: {f.check}{produced_by}", f.error)
            base = os.path.join(self.dir, f"graph_{n}")
            for k, name in pictures.write_picture(canvas, base, self._png_kept).items():
                files[f"graph_{k}"] = name
        if (f.trace or shown.graph is not None) and not any(k.endswith("png") for k in files):
            notes.append("PNG pictures need Pillow (pip install pillow); SVG written")

    def finish(self, status: str = "complete", summary: JsonObject | None = None, text: str | None = None) -> None:
        self._update(status=status)
        if summary is not None:
            self._update(summary=summary)
        if text is not None:
            self._update(summary_text=text)
        self.flush()

    def write_examples(self, rows: Sequence[Mapping[str, object]]) -> None:
        """``examples.jsonl``: each generated example's outcome, one JSON object a line, in sequence order -- what
        two runs of the same seed compare example by example (``explorer.exploration.GeneratedRun``)."""
        replace_file(os.path.join(self.dir, "examples.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))

    def flush(self) -> None:
        self._update(run=_replace(self.model.run, seconds=round(time.monotonic() - self._t0, 2)))
        if self.model.harness_errors is not None or any(e.labels for e in self.model.findings):
            self._update(harness_errors=tuple(HarnessError(e.n, e.key, e.harness_error)
                                              for e in self.model.findings if e.harness_error))
        replace_file(os.path.join(self.dir, "report.json"), json.dumps(self.model.to_json(), indent=2) + "\n")
        replace_file(os.path.join(self.dir, "report.md"), render_markdown(self.model))


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


def _around(events: Sequence[Event] | None, violation: int | None) -> tuple[AroundEvent, ...]:
    if not events:
        return ()
    at = violation if violation is not None else len(events) - 1
    lo, hi = max(0, at - AROUND), min(len(events), at + AROUND + 1)
    return tuple(AroundEvent(i, str(events[i]), i == violation) for i in range(lo, hi))


__all__ = ["Report", "Shown"]
