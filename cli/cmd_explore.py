"""``zerostate explore``: explore real DeepSpeed (or a model design) and write a report.

Each finding is written to the report as soon as it is found, unshrunk (the first example with its
key), then rewritten under the same number with its shrunk, confirmed scenario; Ctrl-C keeps them.
The default budget is examples only (repeatable: the same command finds the same findings on every
run); ``--time-budget`` is opt-in and a run it cuts says so (it is not repeatable).  ``--jobs N``
runs the examples on N workers (rank pools at world size 2) at once; the findings do not depend on N.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

from zerostate.findings.finding import Finding
from zerostate.explorer.confirm import StopExploring

from zerostate.cli import targets_api as api
from zerostate.cli.common import (DEFAULT_OUT, EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_OK, check_world_size, design,
                     non_negative_float, positive_int)
from zerostate.cli.progress import Progress
from zerostate.cli.repro import repro_for

DEFAULT_EXAMPLES = 200
DEFAULT_TIME_BUDGET = 0.0
"""No time budget by default: a run cut by the clock stops at a clock-dependent example (issue 15)."""


class _OutOfTime(StopExploring):
    """Raised from the progress callback when the time budget is spent: the explorer hands over
    what it has seen (confirmed by replay, unlike Ctrl-C) and stops."""



def _prestarted(target: Any) -> Any:
    """The target, with the rank pool of the world-size-2 scenarios the default strategy draws starting in the
    background (`DeepSpeedTarget.prestart`; the model target has none)."""
    prestart = getattr(target, "prestart", None)
    if prestart is not None:
        prestart(2)
    return target

def add_target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=("deepspeed", "model"), default="deepspeed",
                   help="real DeepSpeed (default) or a model design")
    p.add_argument("--design", metavar="NAME", help="model design to explore (with --target model)")
    p.add_argument("--deepspeed", metavar="VERSION", help="DeepSpeed release, in its own cached environment")
    p.add_argument("--deepspeed-path", metavar="DIR", help="local DeepSpeed checkout (e.g. a pull request)")
    p.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="ranks: 1 (default) or 2 (a rank pool on one process group; deepspeed target)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("explore", help="explore DeepSpeed against the model and the PyTorch oracle",
                       description="Explore scenarios drawn by Hypothesis on a target; write a report.")
    add_target_options(p)
    p.add_argument("--examples", type=positive_int, default=DEFAULT_EXAMPLES, metavar="N",
                   help=f"examples per search (default {DEFAULT_EXAMPLES})")
    p.add_argument("--time-budget", type=non_negative_float, default=DEFAULT_TIME_BUDGET, metavar="SECONDS",
                   help="stop exploring after this long (default: none, the examples alone bound the run, "
                        "which makes it repeatable; a run the clock cuts is not); replaying findings in a "
                        "fresh worker to confirm them is not counted")
    p.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                   help="workers at once (rank pools at world size 2; default: the CPUs there are, "
                        "divided by the world size); "
                        "the findings are the same whatever N")
    p.add_argument("--seed", type=int, default=None, metavar="N",
                   help="Hypothesis seed (default: a fixed seed, 0: the same examples every run)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report folder (default {DEFAULT_OUT}/)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerostate.specs import SPECS

    from zerostate.cli.report import Report

    check_world_size(args.world_size)
    if args.target == "model" and args.design:
        design(args.design)
    target = _prestarted(api.target(args))
    jobs = args.jobs or max(1, (os.cpu_count() or 1) // max(1, args.world_size))  # a job at ws 2: two ranks
    if args.target == "model":
        jobs = 1  # a pure function in this process: workers would only share its one interpreter
    who = api.describe_target(target)
    column = column_of(args, who)
    report = Report(args.out, "explore", {**who, "examples": args.examples, "seed": args.seed,
                                          "time_budget": args.time_budget or None, "jobs": jobs,
                                          "command_line": "zerostate " + " ".join(sys.argv[1:])},
                    columns=[column], specs=SPECS, replay_args=_replay_args(args))
    if args.target != "model":  # counted apart from the findings about DeepSpeed, from the start (findings.harness)
        report.data["harness_errors"] = []
    progress = Progress("explore")
    findings: list[dict[str, Any]] = []
    counts = {"examples": 0, "confirming": 0.0}
    t0 = time.monotonic()

    number: dict[str, int] = {}  # finding key -> its number in the report
    final: dict[str, tuple[Finding, bool]] = {}  # finding key -> its latest finding, with its confirmation?

    def on_finding(f: Finding, update: bool = False) -> None:
        key = f.key
        final[key] = (f, update or bool(f.shrunk))
        unshrunk = not f.shrunk and not update
        # handed over at once (unshrunk): shrinking and the replay in a fresh worker follow
        conf = None if unshrunk else f.confirmation
        counts["confirming"] += conf.seconds if conf is not None else 0.0
        n = number.get(key) if update else None
        summary = _write(report, f, not unshrunk, column, who, replace=n)
        report.flush()
        if n:
            findings[n - 1] = summary
        else:
            findings.append(summary)
            number[key] = len(findings)
        progress.update(counts["examples"], len(findings), force=True)

    def on_update(f: Finding) -> None:
        on_finding(f, update=True)

    def on_progress(examples: int, *_: Any, **__: Any) -> None:
        counts["examples"] = examples
        report.data["run"]["examples_run"] = examples
        progress.update(examples, len(findings))
        exploring = time.monotonic() - t0 - counts["confirming"]  # replays confirming findings are extra
        if args.time_budget and exploring > args.time_budget and not counts.get("stop"):
            counts["stop"] = 1
            raise _OutOfTime()

    status = "complete"
    with _ctrl_c_kept() as ctrl_c:
        try:
            spawn = (lambda: _prestarted(api.target(args))) if jobs > 1 else None
            res = api.explore(target, args.examples, args.seed, on_finding, _kept(ctrl_c, on_progress),
                              on_restart=report.add_restart, on_update=on_update, jobs=jobs, spawn=spawn,
                              first=_unexplained)
            with ctrl_c.held():  # renumbering rewrites every finding: never leave it halfway
                _renumber(report, findings, number, final, getattr(res, "generated_at", {}) or {}, column, who)
        except _OutOfTime:
            report.data["run"]["stopped"] = ("time budget spent: the clock chose the last example, so this run "
                                             "is not repeatable")
        except KeyboardInterrupt:
            status = "interrupted"
        finally:
            progress.close()
            try:
                api.close(target)
            except KeyboardInterrupt:  # a second Ctrl-C while closing: the report is still finished
                status = "interrupted"
        if ctrl_c.is_set():
            status = "interrupted"
        ctrl_c.hold()  # from here on a Ctrl-C is only noted: the final report is written whole
        for sid in SPECS:
            if report.data["specs"][sid]["results"][column] == "not checked" and status == "complete":
                report.set_result(sid, column, "ok")
        summary = {"target": who["target"], "deepspeed": who["deepspeed"], "examples": counts["examples"] or
                   args.examples, "seconds": round(time.monotonic() - t0, 2), "findings": findings,
                   "reliability": report.data["reliability"], "startup": api.startup(target)}
        if "harness_errors" in report.data:
            summary["harness_errors"] = report.data["harness_errors"]
        report.finish(status, summary)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"explore {column}: {summary['examples']} example(s), {len(findings)} finding(s), "
              f"{summary['seconds']:.0f}s{' (interrupted)' if status != 'complete' else ''}"
              f"{' (time budget spent)' if report.data['run'].get('stopped') else ''}. "
              f"Report: {args.out}/report.md")
        if report.data["run"].get("stopped"):
            print(f"the time budget ({args.time_budget:g} s) cut this run: which examples ran depends on the "
                  "clock, so another run may find other findings (without --time-budget the examples "
                  "alone bound the run)")
        rel = report.data["reliability"]
        print(f"reliability: {rel['confirmed']}/{rel['reported']} confirmed by replay in a fresh worker, "
              f"{rel['order_dependent']} order-dependent, {rel['intermittent']} intermittent, "
              f"{rel['not_reproduced']} not reproduced, "
              f"{len(rel['restarts'])} worker restart(s)")
        if "harness_errors" in report.data:
            print(f"harness errors: {len(report.data['harness_errors'])} (zerostate's own failures, not findings "
                  "about DeepSpeed)")
        for i, f in enumerate(findings, 1):
            print(f"  #{i} {f['check']}: {f['error'].splitlines()[0] if f['error'] else ''}{_tag(f)}")
    if status == "interrupted":
        return EXIT_INTERRUPTED
    return EXIT_FINDINGS if findings else EXIT_OK


class _CtrlC(threading.Event):
    """Set by the first Ctrl-C (SIGINT) of a run and never cleared; ``hold()``: later ones are only noted."""

    raising = True

    def hold(self) -> None:
        self.raising = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Only note a Ctrl-C during the block; raise KeyboardInterrupt after it if one came."""
        self.raising = False
        try:
            yield
        finally:
            self.raising = True
        if self.is_set():
            raise KeyboardInterrupt


@contextlib.contextmanager
def _ctrl_c_kept() -> Iterator[_CtrlC]:
    """A Ctrl-C is never lost.  Python raises KeyboardInterrupt wherever the main thread happens to be when the
    signal is handled, and where that is a garbage-collector callback (Hypothesis keeps one in ``gc.callbacks``
    to time collections), a ``__del__`` or a weakref callback, the interpreter prints "Exception ignored in
    ..." and drops it: the run went on exploring as if nothing had happened (the intermittent Ctrl-C hang of
    the CI test).  So SIGINT also sets an event, and `_kept` raises KeyboardInterrupt again from the next
    ``on_progress`` (called after every distinct run) while it is set.  A SIGINT the process ignores (a
    background job started by a shell) stays ignored; off the main thread nothing is installed."""
    seen = _CtrlC()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield seen
        return

    def handler(signum: int, frame: Any) -> None:
        seen.set()
        if seen.raising:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _tag(f: dict[str, Any]) -> str:
    """A summary line's label: a harness error, a known bug or a known (documented) limitation."""
    if f.get("harness_error"):
        return f" [harness error: {f['harness_error']}]"
    k = f.get("known_issue")
    if not k:
        return ""
    return f" [known {'limitation' if k.get('nature') == 'limitation' else 'bug'}: {k['id']}]"


def _unexplained(f: Finding) -> bool:
    """No known issue explains it (`grouping.label`): the explorer shrinks these first."""
    from zerostate.known.labels import label
    return label(f) is None


def _kept(ctrl_c: _CtrlC, on_progress: Any) -> Any:
    """``on_progress`` that first raises KeyboardInterrupt when a Ctrl-C came and was swallowed (`_ctrl_c_kept`)."""
    def checked(*a: Any, **k: Any) -> None:
        if ctrl_c.is_set():
            raise KeyboardInterrupt
        on_progress(*a, **k)
    return checked


def _renumber(report: Any, findings: list[dict[str, Any]], number: dict[str, int],
              final: dict[str, tuple[Finding, bool]], generated_at: dict[str, int], column: str,
              who: dict[str, Any]) -> None:
    """A complete run's findings are numbered in the order the generated sequence first meets them (then,
    for keys seen only while shrinking, by key), whatever order the workers handed them over in: with
    ``--jobs`` > 1 the hand-over order follows the lanes' timing, so the same run could number the same
    findings differently (issue 15: two runs of one command give the same report).  Rewrites the report
    only when the order differs."""
    keys = sorted(number, key=lambda k: (generated_at.get(k, float("inf")), k))
    if keys == sorted(number, key=number.get):
        return
    report.clear_findings()
    findings.clear()
    number.clear()
    for key in keys:
        f, confirmed = final[key]
        findings.append(_write(report, f, confirmed, column, who))
        number[key] = len(findings)
    report.flush()


def _write(report: Any, f: Finding, confirmed: bool, column: str, who: dict[str, Any],
           replace: int | None = None) -> dict[str, Any]:
    """Write one finding into the report (as finding ``replace``, or as the next one) with its known-issue
    and root-cause tags; return its line of the JSON summary.  ``confirmed``: it is past the hand-over
    (shrunk, or as seen), so its confirmation is shown; before, it is ``unshrunk``."""
    conf = f.confirmation if confirmed else None
    entry = report.add_finding(f, column=column, replace=replace, with_confirmation=confirmed, **shown(f, who))
    entry["shrunk"] = f.shrunk
    if entry["shrunk"] is False:
        entry["stage"] = "as seen" if confirmed else "unshrunk"
    tags = _annotate(f)  # known issue and root-cause group (known/labels.py)
    entry.update(tags)
    sc = f.scenario
    return {"check": f.check, "error": f.error, "blocks": len(sc.blocks), "steps": len(sc.steps),
            "scenario": sc.to_dict(), "shrunk": entry["shrunk"],
            "confirmation": conf.status if conf is not None else None, **tags}


def shown(f: Finding, who: dict[str, Any]) -> dict[str, Any]:
    """How the report shows a target's finding (`report.Shown`'s fields): who produced it, its repro script."""
    return {"design": who["design"] if who["target"] == "model" else None,
            "where": None if who["target"] == "model" else f"DeepSpeed {who['deepspeed']}",
            "repro": repro_for(f.scenario, f.check, f.error, f)}


def _annotate(f: Finding) -> dict[str, Any]:
    """Known-issue label and root-cause group of a real DeepSpeed finding ({} for a model design's: known.py
    describes DeepSpeed releases)."""
    if not f.deepspeed:
        return {}
    from zerostate.known.labels import annotate
    return annotate(f)


def column_of(args: argparse.Namespace, who: dict[str, Any]) -> str:
    return f"model:{who['design']}" if args.target == "model" else f"deepspeed {who['deepspeed'] or ''}".strip()


def _replay_args(args: argparse.Namespace) -> str:
    if args.target == "model":
        return f" --target model --design {args.design or 'zerostate'}"
    if getattr(args, "world_size", 1) != 1:
        args2 = argparse.Namespace(**{**vars(args), "world_size": 1})
        return _replay_args(args2) + f" --world-size {args.world_size}"
    if args.deepspeed:
        return f" --deepspeed {args.deepspeed}"
    if args.deepspeed_path:
        return f" --deepspeed-path {args.deepspeed_path}"
    return ""


__all__ = ["DEFAULT_EXAMPLES", "add_parser", "add_target_options", "column_of", "run", "shown"]
