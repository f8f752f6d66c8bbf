"""``zerostate check``: the exhaustive model check, a design x spec table, and a report."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zerostate.reports import model_counterexample
from zerostate.cli.common import DEFAULT_OUT, EXIT_FINDINGS, EXIT_OK, CliError, design, need, positive_int


def add_parser(sub: Any) -> None:
    p = sub.add_parser("check", help="exhaustive model check of designs up to a bound",
                       description="Check every scenario up to the bound, every interleaving, for each design.")
    p.add_argument("--design", action="append", metavar="NAME",
                   help="design to check (repeatable; default: every design)")
    p.add_argument("--spec", action="append", metavar="ID", help="spec to check (repeatable; default: all)")
    p.add_argument("--max-blocks", type=positive_int, default=None, metavar="N", help="largest network (blocks)")
    p.add_argument("--max-micro-steps", type=positive_int, default=None, metavar="N",
                   help="most micro-steps (backward calls) per scenario")
    p.add_argument("--jobs", type=positive_int, default=None, metavar="N", help="worker processes (default: CPUs)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report folder (default {DEFAULT_OUT}/)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    checker = need("zerostate.analysis.checker", "zerostate check")
    from zerostate.model.designs import designs
    from zerostate.specs import SPECS

    from zerostate.reports.report_folder import Report

    names = args.design or list(designs())
    for n in names:
        design(n)  # unknown design: an error listing the known ones, before any work
    for sid in args.spec or ():
        if sid not in SPECS:
            raise CliError(f"--spec {sid}: unknown spec; known specs: {', '.join(SPECS)}")
    bound_kw = {k: v for k, v in (("max_blocks", args.max_blocks), ("max_micro_steps", args.max_micro_steps))
                if v is not None}
    bound = checker.Bound(**bound_kw)
    from zerostate.cli.progress import note
    note(f"checking {len(names)} design(s) over {_bound_text(bound)}; this can take minutes")
    result = checker.check(names, bound, spec_ids=args.spec, jobs=args.jobs)
    report = Report(args.out, "check", {"target": "model", "bound": _bound_text(bound),
                                        "command_line": "zerostate " + " ".join(sys.argv[1:])},
                    columns=names, specs={k: v for k, v in SPECS.items() if not args.spec or k in args.spec})
    for name, d in result.designs.items():
        for sid in d.checked:
            judged = sid in d.judged
            report.set_result(sid, name, "holds" if d.holds(sid) else "violated" if judged else "violated (not judged)")
            if not d.holds(sid) and judged:
                f = model_counterexample.finding(d.violations[sid], *d.counterexamples[sid])
                report.add_finding(f, column=name, replay_args=f" --target model --design {name}",
                                   **model_counterexample.shown(name, f))
    summary = result.to_json()
    report.finish("complete", summary, text=table(result))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(table(result))
        print(f"\n{'ok' if result.ok else 'FAILED'}: every design expected to be correct "
              f"{'holds' if result.ok else 'does not hold'}; {result.seconds:.1f}s. Report: {args.out}/report.md")
    return EXIT_OK if result.ok else EXIT_FINDINGS


def _bound_text(b: Any) -> str:
    return (f"up to {b.max_blocks} block(s), {b.max_micro_steps} micro-step(s), ZeRO stage(s) "
            f"{', '.join(map(str, b.stages))}; coordinator specs up to "
            f"{getattr(b, 'coordinator_max_blocks', b.max_blocks)} block(s), "
            f"{getattr(b, 'coordinator_max_micro_steps', b.max_micro_steps)} micro-step(s); "
            "each design on the specs of its family ('-': not judged, not checked)")


def table(result: Any) -> str:
    spec_ids = list(dict.fromkeys(s for d in result.designs.values() for s in d.checked))
    header = ["design", "expected"] + spec_ids + ["states", "seconds"]
    rows = []
    for n, d in result.designs.items():
        cells = ["-" if s not in d.checked else "holds" if d.holds(s)
                 else "VIOLATED" if s in d.judged else "violated (not judged)" for s in spec_ids]
        rows.append([n, "correct" if d.expected_correct else "buggy"] + cells
                    + [str(d.states), f"{d.seconds:.1f}"])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


__all__ = ["add_parser", "run", "table"]
