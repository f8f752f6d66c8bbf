"""``zerostate watch [--out DIR] [--stop-on-violation] [--runtime] -- COMMAND ...``: check a user's own job.

Runs COMMAND (``python train.py``, ``accelerate launch ...``, ``torchrun ...``, ``deepspeed --num_gpus N
...``) watched (`zerostate.watcher.job_launch`): every DeepSpeed engine of every rank traced, every hook and
coordinator spec checked on the real events, ``DIR/report.json`` and ``report.md`` rewritten while the job
runs and at its end.  The exit status is COMMAND's (a signal death reads 128+N), except that a job that exited 0
but that the watch did not fully observe -- no engine watched, a rank of its world size never watched, a spec no
event exercised ("not observed"), a rank gone before its events were checked, ``--runtime`` not installed -- exits
3 (`zerostate.watcher.job_launch.NOT_OBSERVED`), each problem on a ``watch: NOT OBSERVED:`` line; the last line
printed is ``watch: N violations in M backwards, K steps ...``.  Ctrl-C reaches the job (same process group) and
the report keeps everything seen; ``"status": "interrupted"``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

from zerostate.watcher.job_launch import JobNotStarted, WatchOptions, exit_status, run_watched

from zerostate.cli.common import DEFAULT_OUT, CliError, non_negative_float


def add_parser(sub: Any) -> None:
    p = sub.add_parser("watch", help="run your own DeepSpeed job with the specs checked live",
                       description=("Run COMMAND with zerostate's tracer in every DeepSpeed engine of every rank; "
                                    "check every hook and coordinator spec on the real events; write a report."),
                       usage="zerostate watch [--out DIR] [--stop-on-violation] [--runtime] [--hang-after S] "
                             "-- COMMAND ...")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report folder (default {DEFAULT_OUT}/)")
    p.add_argument("--stop-on-violation", action="store_true",
                   help="stop the job (raise in it) at the end of the engine call that saw the first violation")
    p.add_argument("--runtime", action="store_true", help="install zerostate.runtime into every engine as well")
    p.add_argument("--hang-after", type=non_negative_float, default=300.0, metavar="S",
                   help="write a rank's stack when one engine call lasts longer than S seconds (0: never; default 300)")
    p.add_argument("job", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    job = list(args.job)
    if job and job[0] == "--":
        job = job[1:]
    if not job:
        raise CliError("watch: no command given (zerostate watch [options] -- COMMAND ...)")
    if shutil.which(job[0]) is None and not os.path.exists(job[0]):
        raise CliError(f"watch: {job[0]}: command not found")
    try:
        rc, data = run_watched(job, args.out, WatchOptions(args.stop_on_violation, args.runtime, args.hang_after))
    except JobNotStarted as exc:
        raise CliError(f"watch: cannot run {job[0]}: {exc}") from None
    for problem in data["not_observed"]:
        print(f"watch: NOT OBSERVED: {problem}", file=sys.stderr)
    print(f"watch: {data['summary_text']} (report: {os.path.join(args.out, 'report.md')})", file=sys.stderr)
    return exit_status(rc, data)


__all__ = ["add_parser", "run"]
