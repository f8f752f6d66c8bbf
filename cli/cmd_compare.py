"""``zerostate compare A B``: two designs over the same scenarios, side by side (analysis/design_comparison.py).

Prints `Comparison.to_text()` (or ``--json``: `Comparison.to_json()`), and writes a report
whose spec table has one column per design and a finding (trace picture, state graph,
repro script) for each spec a design violates, on its first counterexample.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zerostate.reports import model_counterexample
from zerostate.cli.common import DEFAULT_OUT, EXIT_OK, design, need, positive_int


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="two designs side by side: specs, gathered-peak, all-gathers",
                       description="Run two designs over the same scenarios and compare them.")
    p.add_argument("design_a", metavar="DESIGN_A")
    p.add_argument("design_b", metavar="DESIGN_B")
    p.add_argument("--max-blocks", type=positive_int, default=2, metavar="N", help="largest network compared (2)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report folder (default {DEFAULT_OUT}/)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    design(args.design_a)
    design(args.design_b)
    mod = need("zerostate.analysis.design_comparison", "zerostate compare")
    from zerostate.specs import SPECS

    from zerostate.reports.report_folder import Report

    a, b = args.design_a, args.design_b
    result = mod.compare(a, b, scenarios=mod.default_scenarios(args.max_blocks))
    data = result.to_json()
    report = Report(args.out, "compare", {"target": "model", "design": f"{a} vs {b}",
                                          "bound": f"{data['scenarios']} scenario(s), up to {args.max_blocks} "
                                                   "block(s)",
                                          "command_line": "zerostate " + " ".join(sys.argv[1:])},
                    columns=[a, b], specs=SPECS)
    for sid, row in data["specs"].items():
        for name in (a, b):
            report.set_result(sid, name, "holds" if row[name]["holds"] else "violated")
            first = result.first_violation(name, sid)
            if first is not None:
                sc, v, events = first
                f = model_counterexample.finding(v, sc, events)
                report.add_finding(f, column=name, replay_args=f" --target model --design {name}",
                                   **model_counterexample.shown(name, f))
    report.finish("complete", data, text=result.to_text())
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(result.to_text())
        print(f"\nReport: {args.out}/report.md")
    return EXIT_OK


__all__ = ["add_parser", "run"]
