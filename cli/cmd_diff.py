"""``zerostate diff --base REL|PATH --head REL|PATH``: one exploration on two DeepSpeed builds, side by side.

For a pull request: the same exploration (same seed, same example budget, so the same generated scenario
sequence) runs on the base build and on the head build (a release, installed as needed, or a checkout,
e.g. the pull request's tree).  Every finding is then replayed on the other build (`diff_classify`: once,
then, when that run does not show it, as often as the explorer replays a finding before it calls it not
reproduced) and classified:

* **fixed**: found on base; no replay on head shows it (the same mechanism: `diff_classify.same_bug`), and
  head's run went past the train step where base failed;
* **not-reached**: found on base; head's replay stopped before that step (raised earlier, or zerostate could not
  observe it): not judged, never "fixed";
* **intermittent**: a replay on the other build shows it in some runs but not in the first;
* **introduced**: found on head; no replay on base shows it -- also when base fails there under the same
  known issue by another mechanism (a crash swapped for another);
* **unmasked**: found on head; base does not show it because it stopped earlier (DeepSpeed raised) or
  another bug changed its course, and a known issue affecting the base release explains it -- an existing
  bug that a fix lets the run reach (fixing ``z3-leaf-input-without-grad`` reveals
  ``z3-leaf-kept-gathered``); reported, not counted as introduced;
* **unchanged**: both show it (whichever exploration found it).

Each keeps the other side's replay as evidence.  The scenarios both explorations ran to the end are
compared for real gathered-parameter memory and all-gathers (`diff_metrics`), per scenario family.
Exit status 1 when head introduces a finding or raises the gathered-parameter peak of some scenario
beyond ``--memory-tolerance`` (default 10 %); 0 otherwise; 2 bad input or a build that fails to run
(one line); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import contextlib
from types import SimpleNamespace
from typing import Any
from collections.abc import Callable, Sequence

from zerostate.explorer.exploration_events import Progress
from zerostate.explorer.workers import refresh
from zerostate.findings.finding import Finding
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Target

from zerostate.cli import targets_api as api
from zerostate.cli.common import EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_OK, CliError, check_world_size, load_scenario, \
    non_negative_float, positive_int
from zerostate.cli.cmd_explore import TimeBudget, _ctrl_c_kept, add_fork_server_option, clock
from zerostate.reports.diff_classify import STATUSES, classify, first_line, repeat_runs
from zerostate.cli.progress import Progress as ProgressLine

DEFAULT_OUT = "zerostate-diff"
DEFAULT_EXAMPLES = 200
DEFAULT_TIME_BUDGET = 0.0
"""No time budget by default (as explore): the examples alone bound each side, so the diff is repeatable."""
DEFAULT_TOLERANCE = 0.10


def add_parser(sub: Any) -> None:
    p = sub.add_parser("diff", help="explore two DeepSpeed builds the same way: what head fixes and introduces",
                       description="Run one exploration (same seed, same scenarios) on a base and a head "
                                   "DeepSpeed build; classify every finding fixed / introduced / unchanged "
                                   "with the other build's replay as evidence; compare gathered-parameter "
                                   "memory and all-gathers per scenario family.")
    p.add_argument("--base", required=True, metavar="REL|PATH", help="base build: a release (0.19.2) or a checkout")
    p.add_argument("--head", required=True, metavar="REL|PATH", help="head build: a release or a checkout")
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks: 1 (default), 2, 4 or 8")
    p.add_argument("--examples", type=positive_int, default=DEFAULT_EXAMPLES, metavar="N",
                   help=f"examples per search, on each build (default {DEFAULT_EXAMPLES})")
    p.add_argument("--time-budget", type=non_negative_float, default=DEFAULT_TIME_BUDGET, metavar="SECONDS",
                   help="stop each build's exploration after this long (default: none, the examples alone "
                        "bound it, which makes the diff repeatable; a side the clock cuts is not)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="Hypothesis seed (default: the fixed seed 0)")
    p.add_argument("--memory-tolerance", type=non_negative_float, default=DEFAULT_TOLERANCE, metavar="FRACTION",
                   help="a head gathered-parameter peak above base x (1 + FRACTION) in any scenario is a "
                        f"regression (default {DEFAULT_TOLERANCE})")
    p.add_argument("--scenario", action="append", default=[], metavar="FILE",
                   help="a scenario file (or finding_<n>.json) run on both builds besides the exploration, its "
                        "findings classified the same way (repeatable): e.g. the bug a pull request fixes")
    add_fork_server_option(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report folder (default {DEFAULT_OUT}/)")
    p.set_defaults(run=run)


class Recorder(Target):
    """A build under diff: a target whose runs are memoised by scenario, with the gathered-parameter metrics of
    its finished ZeRO-3 runs; `repeat` makes fresh, unmemoised runs (a finding's replays before it is called
    fixed).  To the exploration it is a target never started afresh (``can_refresh`` False): a memoised run
    would not run again in a fresh worker; `repeat` starts the build's own target afresh."""

    def __init__(self, target: Target):
        self.target = target
        self.name = target.name
        self.version = target.version
        self.design = target.design
        self.outcomes: dict[Scenario, Outcome] = {}
        self.gathered: dict[Scenario, dict[str, int]] = {}  # finished ZeRO-3 runs' metrics

    def run(self, sc: Scenario) -> Outcome:
        from zerostate.explorer.gathered import gathered_metrics
        if sc not in self.outcomes:
            out = api.run_scenario(self.target, sc)
            self.outcomes[sc] = out
            m = gathered_metrics(sc, out)
            if m is not None:
                self.gathered[sc] = m
        return self.outcomes[sc]

    def repeat(self, sc: Scenario, shows: Callable[[Outcome], bool], before: Sequence[Scenario], runs: int,
               max_seconds: float) -> tuple[int, int]:
        return repeat_runs(lambda s: api.run_scenario(self.target, s), lambda: refresh(self.target), sc, shows,
                           before, runs, max_seconds)

    def close(self) -> None:
        api.close(self.target)


def build(spec: str, option: str, world_size: int) -> tuple[Target, str]:
    """``REL|PATH`` -> (target, how the report names it)."""
    path = os.path.isdir(os.path.expanduser(spec))
    if not path and (os.sep in spec or spec.startswith(".")):
        raise CliError(f"{option} {spec}: no such directory (expected a DeepSpeed release such as 0.19.8, or "
                       "the root of a DeepSpeed checkout)")
    ns = SimpleNamespace(target="deepspeed", design=None, deepspeed=None if path else spec,
                         deepspeed_path=spec if path else None, world_size=world_size, check_release=True)
    try:
        t = api.target(ns)
    except CliError as exc:
        raise CliError(f"{option} {spec}: {exc}") from None
    return t, (f"{spec} (DeepSpeed {t.version})" if path else f"DeepSpeed {t.version}")


def explore_side(rec: Recorder, label: str, args: argparse.Namespace, ctrl_c: Any) -> tuple[list[Finding], str]:
    """One build's exploration: its findings (each key's last) and how it ended.  A spent time budget asks
    the exploration to stop (what it saw is kept, confirmed); a Ctrl-C Python swallowed closes it."""
    progress = ProgressLine(f"diff {label}")
    budget = TimeBudget(args.time_budget, clock)
    exp = api.exploration(rec, args.examples, args.seed)
    try:
        with contextlib.closing(exp.events()) as stream:
            for ev in stream:
                if ctrl_c.is_set():
                    break
                if isinstance(ev, Progress):
                    progress.update(ev.examples_run, ev.findings)
                    if budget.spent():
                        exp.request_stop()
    finally:
        progress.close()
    if ctrl_c.is_set():
        raise KeyboardInterrupt
    res = exp.result()
    return res.findings, "time budget spent" if res.stopped else "complete"


def run(args: argparse.Namespace) -> int:
    from zerostate.reports.diff_memory import compare
    from zerostate.reports.diff_model import DiffReport, DiffSide
    from zerostate.reports.diff_report import write_report
    check_world_size(args.world_size)
    extra = [load_scenario(path) for path in args.scenario]  # bad files fail before any build starts
    t0 = time.monotonic()
    base_t, base_name = build(args.base, "--base", args.world_size)
    try:
        head_t, head_name = build(args.head, "--head", args.world_size)
    except BaseException:
        api.close(base_t)
        raise
    base, head = Recorder(base_t), Recorder(head_t)
    status = "complete"
    try:
        with _ctrl_c_kept() as ctrl_c:  # a Ctrl-C Python drops inside a gc callback still stops the run
            base_found, st_b = explore_side(base, "base", args, ctrl_c)
            head_found, st_h = explore_side(head, "head", args, ctrl_c)
            for sc in extra:  # the given scenarios: every finding of theirs joins its side's (asked for by name)
                base_found += base.run(sc).findings
                head_found += head.run(sc).findings
            entries = classify(base_found, head_found, base, head)
    except KeyboardInterrupt:
        status, entries, st_b, st_h = "interrupted", [], "interrupted", "interrupted"
    finally:
        base.close()
        head.close()
    pairs = [(sc, m, head.gathered[sc]) for sc, m in base.gathered.items() if sc in head.gathered]
    memory = compare(pairs, args.memory_tolerance)
    counts = {s: sum(e.status == s for e in entries) for s in STATUSES}
    regress = bool(memory.regressions)
    result = DiffReport(
        DiffSide(args.base, base_name, base.version, len(base.outcomes), st_b),
        DiffSide(args.head, head_name, head.version, len(head.outcomes), st_h),
        status, args.examples, tuple(args.scenario), args.seed, args.world_size, round(time.monotonic() - t0, 1),
        counts, tuple(entries), memory, "zerostate " + " ".join(sys.argv[1:]),
        verdict=("interrupted" if status != "complete" else
                 "head introduces findings" if counts["introduced"] else
                 "head regresses gathered-parameter memory" if regress else "no regression"))
    write_report(args.out, result)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(f"diff {base_name} -> {head_name}: {counts['fixed']} fixed, {counts['not-reached']} not reached, "
              f"{counts['introduced']} introduced, "
              f"{counts['intermittent']} intermittent, {counts['unmasked']} unmasked, {counts['unchanged']} unchanged; "
              f"{len(pairs)} ZeRO-3 scenario(s) compared, "
              f"{len(memory.regressions)} memory regression(s) beyond {args.memory_tolerance:.0%}; "
              f"{result.seconds:.0f}s. Report: {args.out}/diff.md")
        for e in result.findings:
            known = f" [{e.known_issue.id}]" if e.known_issue else ""
            print(f"  {e.status:<12} {e.check}: {first_line(e.error)[:120]}{known}")
    if status != "complete":
        return EXIT_INTERRUPTED
    return EXIT_FINDINGS if counts["introduced"] or regress else EXIT_OK


__all__ = ["DEFAULT_OUT", "Recorder", "add_parser", "classify", "run"]
