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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

from zerostate.explorer.exploration_events import Confirmed, FindingEvent, Progress, Renumbered, Restarted, Seen
from zerostate.explorer.time_spent import time_line
from zerostate.findings.finding import Finding
from zerostate.targets.interface import Target, TargetError

from zerostate.cli import cluster_cli, targets_api as api
from zerostate.reports.run_report import NOT_EXERCISED
from zerostate.cli.common import (DEFAULT_OUT, EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_OK, CliError, check_world_size,
                                  design,
                     non_negative_float, positive_int)
from zerostate.cli.progress import Progress as ProgressLine
from zerostate.reports.repro_file import repro_for

if TYPE_CHECKING:
    from zerostate.reports.finding_entry import Labels
    from zerostate.reports.report_folder import Report

DEFAULT_EXAMPLES = 200
STEERS = ("coverage",)
"""``--steer``'s choices (`explorer.exploration.STEERS` less the default; that module imports Hypothesis)."""
DEFAULT_TIME_BUDGET = 0.0
"""No time budget by default: a run cut by the clock stops at a clock-dependent example."""


def _prestarted(target: Target) -> Target:
    """The target, with the rank pool of the world-size-2 scenarios the default strategy draws starting in the
    background (`DeepSpeedTarget.prestart`; the model target has none to start)."""
    target.prestart(2)
    return target

def add_target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=("deepspeed", "model"), default="deepspeed",
                   help="real DeepSpeed (default) or a model design")
    p.add_argument("--design", metavar="NAME", help="model design to explore (with --target model)")
    p.add_argument("--deepspeed", metavar="VERSION", help="DeepSpeed release, in its own cached environment; "
                   "explore: a list (0.18.4,0.19.2,0.19.8) or range (0.19.2..0.19.8) for a release matrix")
    p.add_argument("--deepspeed-path", metavar="DIR", help="local DeepSpeed checkout (e.g. a pull request)")
    p.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="ranks: 1 (default), 2, 4 or 8 (a rank pool on one process group; deepspeed target); "
                        "at 1 the scenarios drawn at world size 2 still run on 2 ranks")
    add_fork_server_option(p)


def add_fork_server_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-fork-server", action="store_true",
                   help="start every DeepSpeed worker and rank as a new process (default: fork them from a "
                        "warm server per release, which pays the imports and warm-up once; the same runs)")


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
    p.add_argument("--steer", choices=STEERS, default=None,
                   help="coverage: generate in rounds of 50 distinct examples, each round's draw rates moved "
                        "towards the choices whose examples ran DeepSpeed ZeRO code (arcs) and spec-monitor "
                        "states no earlier example had (every example traced by coverage.py, "
                        "several times slower: docs/benchmarks-coverage.md); the first round is the default "
                        "sequence's start, the findings do not depend on --jobs, and the report records every "
                        "round's rates (default: the fixed rates)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report folder (default {DEFAULT_OUT}/)")
    cluster_cli.add_option(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerostate.specs import SPECS

    from zerostate.reports.report_folder import Report

    check_world_size(args.world_size)
    from zerostate.cli import matrix
    cols = matrix.columns(args)
    _check_steer(args, cols is not None)
    if cols is not None:  # a list or range of releases (or designs): one report, finding x release
        return matrix.run(args, cols)
    if args.target == "model" and args.design:
        design(args.design)
    cluster = cluster_cli.open_cluster(args)
    try:
        target = cluster.target() if cluster else _prestarted(api.target(args))
    except BaseException:
        if cluster:
            cluster.close()
        raise
    jobs = args.jobs or max(1, (os.cpu_count() or 1) // max(1, args.world_size))  # a job at ws 2: two ranks
    if cluster:
        jobs = cluster.jobs(args.jobs)
    elif args.target == "model":
        jobs = 1  # a pure function in this process: workers would only share its one interpreter
    target_info = api.describe_target(target)
    shown_as = _Column(column_of(args, target_info), target_info)
    report = Report(args.out, "explore", {**target_info, "examples": args.examples, "seed": args.seed,
                                          "time_budget": args.time_budget or None, "jobs": jobs,
                                          **({"steer": args.steer} if args.steer else {}),
                                          "command_line": "zerostate " + " ".join(sys.argv[1:]),
                                          **({"cluster": cluster.describe()} if cluster else {})},
                    columns=[shown_as.column], specs=SPECS, replay_args=_replay_args(args))
    if args.target != "model":  # counted apart from the findings about DeepSpeed, from the start (findings.harness)
        report.count_harness_errors()
    progress = ProgressLine("explore")
    budget = TimeBudget(args.time_budget, clock)
    spawn = (cluster.target if cluster else lambda: _prestarted(api.target(args))) if jobs > 1 else None
    exp = api.exploration(target, args.examples, args.seed, jobs=jobs, spawn=spawn, first=_unexplained,
                          **({"steer": args.steer} if args.steer else {}))
    failure: CliError | None = None
    with _ctrl_c_kept() as ctrl_c:
        try:
            status = _follow(exp, report, shown_as, progress, budget, ctrl_c)
        except KeyboardInterrupt:
            status = "interrupted"
        except (CliError, TargetError) as exc:  # the target broke: the report keeps what was found, then one line
            status, failure = "interrupted", api.target_failed(exc, exp.result().examples)
            report.set_stopped(str(failure))
        finally:
            progress.close()
            try:
                api.close(target)
            except KeyboardInterrupt:  # a second Ctrl-C while closing: the report is still finished
                status = "interrupted"
            finally:
                if cluster:  # lanes the cluster ran again (a worker or node lost) are counted, never hidden
                    report.set_cluster_retries(cluster.retries())
                    cluster.close()
        if ctrl_c.is_set():
            status = "interrupted"
        ctrl_c.hold()  # from here on a Ctrl-C is only noted: the final report is written whole
        res = exp.result()
        if res.stopped:
            report.set_stopped("time budget spent: the clock chose the last example, so this run is not repeatable")
        for sid in SPECS:  # "ok" needs an observation: a spec no run gave anything to judge is not exercised
            if report.model.specs[sid].results[shown_as.column] == "not checked" and status == "complete":
                report.set_result(sid, shown_as.column, "ok" if sid in res.exercised else NOT_EXERCISED)
        findings = [e.summary_line() for e in report.model.findings]
        summary = {"target": target_info["target"], "deepspeed": target_info["deepspeed"],
                   "examples": res.examples or args.examples, "skipped": res.skipped,
                   "not_exercised": sorted(sid for sid in SPECS if sid not in res.exercised),
                   "seconds": round(budget.elapsed(), 2), "findings": findings, "reliability": _reliability(report),
                   "startup": api.startup(target)}
        if res.time is not None:
            summary["time"] = res.time
        if report.model.harness_errors is not None:
            summary["harness_errors"] = [h.to_json() for h in report.model.harness_errors]
        if res.pairs is not None:
            report.set_pairs(res.pairs)
            summary["pairs"] = res.pairs
        if res.goals is not None:
            summary["goals"] = res.goals
        if res.schedules:
            report.set_steering(_steering(res))
            summary["steering"] = {"rounds": len(res.schedules), "new_units": res.new_units}
        report.write_examples(res.generated)
        report.finish(status, summary)
    if failure is not None:
        raise failure
    _print_summary(args, summary, report, shown_as.column, status)
    if status == "interrupted":
        return EXIT_INTERRUPTED
    return EXIT_FINDINGS if findings else EXIT_OK


@dataclass(frozen=True)
class _Column:
    """Where a finding goes in the report: its column and the target that produced it."""

    column: str
    target_info: dict[str, Any]


@dataclass
class TimeBudget:
    """``--time-budget``: exploring time, read from ``clock``, minus the replays that confirm findings."""

    limit: float
    """Seconds; 0: no budget."""
    clock: Callable[[], float]
    replaying: float = 0.0
    start: float = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def spent(self) -> bool:
        return bool(self.limit) and self.elapsed() - self.replaying > self.limit


clock: Callable[[], float] = time.monotonic
"""The clock `TimeBudget` reads (a test gives a fake one: no test depends on the machine's speed)."""


def _follow(exp: Any, report: Report, shown_as: _Column, progress: ProgressLine, budget: TimeBudget,
            ctrl_c: _CtrlC) -> str:
    """Consume the exploration's events into the report; the run's status.  A Ctrl-C that Python swallowed
    (`_ctrl_c_kept`) closes the stream at the next event; a spent budget asks it to stop."""
    with contextlib.closing(exp.events()) as stream:
        for ev in stream:
            if ctrl_c.is_set():
                return "interrupted"
            if isinstance(ev, FindingEvent):
                with ctrl_c.held():  # a finding is written whole, its tags with it, or not at all
                    _write(report, ev, shown_as)
                if isinstance(ev, Confirmed) and ev.finding.confirmation is not None:
                    budget.replaying += ev.finding.confirmation.seconds
                progress.update(report.model.run.examples_run or 0, len(report.model.findings), force=True)
            elif isinstance(ev, Progress):
                report.set_examples_run(ev.examples_run)
                progress.update(ev.examples_run, len(report.model.findings))
                if budget.spent():
                    exp.request_stop()
            elif isinstance(ev, Restarted):
                report.add_restart(ev.to_dict())
            elif isinstance(ev, Renumbered):
                with ctrl_c.held():  # renumbering rewrites every finding: never leave it halfway
                    _renumber(report, ev, shown_as)
    return "complete"


def _check_steer(args: argparse.Namespace, matrix: bool) -> None:
    """``--steer`` where it cannot work is one error line, before anything starts."""
    if not args.steer:
        return
    if matrix or args.cluster:
        raise CliError(f"--steer {args.steer} explores one target on this machine: not with a release matrix "
                       "or --cluster")
    import importlib.util
    if args.target == "deepspeed" and importlib.util.find_spec("coverage") is None:
        raise CliError(f"--steer {args.steer} measures DeepSpeed's coverage with coverage.py, which is not "
                       "installed (pip install coverage)")


def _steering(res: Any) -> dict[str, Any]:
    """The report's record of a steered run: every round's draw weights (`explorer.choices.Weights`: per choice
    point, each alternative's weight, today's rates times 16 in round 0), the signal units each round reached
    first, and the round each finding's search replayed."""
    return {"steer": "coverage", "schedules": res.schedules, "new_units": res.new_units,
            "finding_rounds": res.rounds}


def _reliability(report: Report) -> dict[str, Any]:
    """The report's reliability section, as the JSON summary repeats it."""
    assert report.model.reliability is not None, "explore's report counts its reliability"
    return report.model.reliability.to_json()


def _print_summary(args: argparse.Namespace, summary: dict[str, Any], report: Report, column: str,
                   status: str) -> None:
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    findings = summary["findings"]
    print(f"explore {column}: {summary['examples']} example(s), {len(findings)} finding(s), "
          f"{summary['seconds']:.0f}s{' (interrupted)' if status != 'complete' else ''}"
          f"{' (time budget spent)' if report.model.run.stopped else ''}. "
          f"Report: {args.out}/report.md")
    if report.model.run.stopped:
        print(f"the time budget ({args.time_budget:g} s) cut this run: which examples ran depends on the "
              "clock, so another run may find other findings (without --time-budget the examples "
              "alone bound the run)")
    rel = report.model.reliability
    assert rel is not None, "explore's report counts its reliability"
    print(f"reliability: {rel.confirmed}/{rel.reported} confirmed by replay in a fresh worker, "
          f"{rel.order_dependent} order-dependent, {rel.intermittent} intermittent, "
          f"{rel.not_reproduced} not reproduced, "
          f"{len(rel.restarts)} worker restart(s)"
          + (f", {len(rel.cluster_retries)} lane(s) run again on the cluster (a worker lost)"
             if rel.cluster_retries is not None else ""))
    if summary.get("pairs"):
        print(_pairs_line(summary["pairs"]))
    if summary.get("goals"):
        print(_goals_line(summary["goals"]))
    if report.model.harness_errors is not None:
        print(f"harness errors: {len(report.model.harness_errors)} (zerostate's own failures, not findings "
              "about DeepSpeed)")
    not_exercised = summary.get("not_exercised") or []
    print(f"observed: {summary.get('skipped', 0)} example(s) skipped (could not be trained, or not here); "
          + (f"NOT EXERCISED by any run (nothing judged them): {', '.join(not_exercised)}" if not_exercised
             else "every spec exercised by some run"))
    if summary.get("time"):
        print(time_line(summary["time"]))
    for i, f in enumerate(findings, 1):
        print(f"  #{i} {f['check']}: {f['error'].splitlines()[0] if f['error'] else ''}{summary_tag(f)}")


def _pairs_line(p: dict[str, Any]) -> str:
    """What the exploration never ran, said next to what it found (never a silent clean)."""
    left = (f"; NOT RUN (budget spent): {len(p['left'])}, e.g. {', '.join(p['left'][:3])}" if p["left"]
            else "; every drawable pair ran")
    ended = p.get("ended_early") or []
    cut = (f"; {len(ended)} only in runs that ended on an exception (the rest of their scenario did not run), "
           f"e.g. {', '.join(ended[:2])}" if ended else "")
    slow = (f"; its draws were made in this process, the draw helpers failed: {p['draw_helpers_failed']}"
            if p.get("draw_helpers_failed") else "")
    sampled = p.get("not_drawable_by_sampling") or []
    proved = (f" ({len(sampled)} by sampling alone, no rule of explorer/drawable.py says why: "
              f"{', '.join(sampled[:2])})" if sampled else "")
    return (f"setup pairs: {p['missing_after_generation']} not taken by the generated examples; "
            f"{p['examples']} completion example(s) ran them, {len(p['not_drawable'])} not drawable{proved}{left}"
            f"{cut}{slow}")


def _goals_line(g: dict[str, Any]) -> str:
    """Which known issues' families the exploration ran, and how (explorer/goals.py); a family only its repro
    reached is one the strategy does not draw, said by name."""
    if g.get("skipped"):
        return (f"goals: {g['goals']} (known-issue families, survey combinations) NOT RUN ({g['skipped']}): reach "
                "not judged")
    drawn, repro, not_run = g["reached_by_forced_draws"], g["run_as_their_repro"], g.get("not_run") or []
    other = len(g.get("reached_by_another_goals_example") or [])
    return (f"goals: {g['goals']} (known-issue families, survey combinations); {g['reached_by_runs']} reached by "
            "the examples, "
            f"{len(drawn) + other} by a forced draw, {len(repro)} only by their own repro (the strategy does not "
            "draw them" + (f": {', '.join(r.split(':', 1)[1] for r in repro)}" if repro else "") + ")"
            + (f"; NOT RUN, so not reached: {', '.join(n.split(':', 1)[1] for n in not_run)} (the target skipped "
               "its example, or the exploration stopped first)" if not_run else ""))


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
    ..." and drops it, and the run would go on exploring as if nothing had happened.  So SIGINT also sets an
    event, and `_follow` closes the exploration at its next event (one comes after every distinct run).  A SIGINT
    the process ignores (a background job started by a shell) stays ignored; off the main thread nothing is
    installed."""
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


def summary_tag(f: dict[str, Any]) -> str:
    """A summary line's label: a harness error, a known bug or a known (documented) limitation."""
    if f.get("harness_error"):
        return f" [harness error: {f['harness_error']}]"
    k = f.get("known_issue")
    if not k:
        return ""
    return f" [known {'limitation' if k.get('nature') == 'limitation' else 'bug'}: {k['id']}]"


def _unexplained(f: Finding) -> bool:
    """No known issue explains it (`known.labels.label`): the explorer shrinks these first."""
    from zerostate.known.labels import label
    return label(f) is None


def _renumber(report: Report, ev: Renumbered, shown_as: _Column) -> None:
    """A complete run's findings in their final order (the explorer's numbering: the order the generated
    sequence first met them, whatever order the workers handed them over in), files and replay commands
    renamed with them."""
    report.clear_findings()
    for f in ev.findings:
        _write(report, f, shown_as, append=True)
    report.flush()


def _write(report: Report, ev: FindingEvent, shown_as: _Column, append: bool = False) -> None:
    """Write finding ``ev.n`` into the report (a new one for `Seen`, else over the one with its number) with
    its known-issue and root-cause tags.  Past its hand-over (shrunk, or as seen) its confirmation is shown."""
    f = ev.finding
    new = append or isinstance(ev, Seen)
    report.add_finding(f, column=shown_as.column, replace=None if new else ev.n, with_confirmation=ev.past_hand_over,
                       shrunk=f.shrunk, stage=None if f.shrunk else ev.stage.value,
                       labels=_labels(f),  # known issue and root-cause group (known/labels.py)
                       **shown(f, shown_as.target_info))


def shown(f: Finding, target_info: dict[str, Any]) -> dict[str, Any]:
    """How the report shows a target's finding (`report.Shown`'s fields): the target that produced it, its repro
    script."""
    return {"design": target_info["design"] if target_info["target"] == "model" else None,
            "where": None if target_info["target"] == "model" else f"DeepSpeed {target_info['deepspeed']}",
            "repro": repro_for(f.scenario, f.check, f.error, f)}


def _labels(f: Finding) -> Labels | None:
    """Known-issue label and root-cause group of a real DeepSpeed finding (None for a model design's: known.py
    describes DeepSpeed releases)."""
    if not f.deepspeed:
        return None
    from zerostate.known.labels import annotate

    from zerostate.reports.finding_entry import Labels
    return Labels.of(annotate(f))


def column_of(args: argparse.Namespace, target_info: dict[str, Any]) -> str:
    if args.target == "model":
        return f"model:{target_info['design']}"
    return f"deepspeed {target_info['deepspeed'] or ''}".strip()


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


__all__ = ["DEFAULT_EXAMPLES", "add_fork_server_option", "add_parser", "add_target_options", "column_of", "run",
           "shown", "summary_tag"]
