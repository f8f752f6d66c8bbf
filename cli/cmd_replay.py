"""``zerostate replay SCENARIO.json``: run one saved scenario; say pass or fail, and why."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import targets_api as api
from .cmd_explore import add_target_options
from .common import EXIT_FINDINGS, EXIT_OK, check_world_size, design, load_scenario


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="run one saved scenario (a finding_<n>.json or scenario file)",
                       description="Run one saved scenario on a target and say pass or fail with the reason.")
    p.add_argument("scenario", metavar="SCENARIO.json")
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.add_argument("--out", metavar="DIR", help="also write a report folder (with a repro script when it fails)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    check_world_size(args.world_size)
    if args.target == "model" and args.design:
        design(args.design)
    target = api.target(args)
    who = api.describe_target(target)
    try:
        outcome = api.run_scenario(target, scenario)
    finally:
        api.close(target)
    passed, check, error = api.outcome(outcome)
    if args.out:
        _report(args, who, outcome)
    where = f"model design {who['design']}" if args.target == "model" else f"DeepSpeed {who['deepspeed']}"
    if args.json:
        print(json.dumps({**who, "scenario": scenario.to_dict(), "passed": passed, "check": check,
                          "error": error}, indent=2))
    elif passed:
        print(f"PASS on {where}: every spec holds and the PyTorch oracle agrees\n{scenario.describe()}")
    else:
        lines = [ln for ln in error.strip().splitlines() if ln.strip()]
        print(f"FAIL on {where}: {check}: {lines[0] if lines else ''}\n{scenario.describe()}")
        if len(lines) > 1:
            print("details:\n  " + "\n  ".join(lines[1:12]) + ("\n  ..." if len(lines) > 12 else ""))
    return EXIT_OK if passed else EXIT_FINDINGS


def _report(args: argparse.Namespace, who: dict[str, Any], outcome: Any) -> None:
    from zerostate.specs import SPECS

    from .cmd_explore import _replay_args, column_of, record_of
    from .report import Report

    column = column_of(args, who)
    report = Report(args.out, "replay", {**who, "command_line": "zerostate " + " ".join(sys.argv[1:])},
                    columns=[column], specs=SPECS, replay_args=_replay_args(args))
    for f in api.findings(outcome):
        report.add_finding(record_of(f, who), column=column)
    for sid in SPECS:
        if report.data["specs"][sid]["results"][column] == "not checked":
            report.set_result(sid, column, "ok")
    report.finish("complete")


__all__ = ["add_parser", "run"]
