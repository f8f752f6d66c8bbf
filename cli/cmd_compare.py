"""``zerostate compare A B``: two designs over the same scenarios, side by side (model/compare.py)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import DEFAULT_OUT, EXIT_OK, design, need


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="two designs side by side: specs, gathered-peak, all-gathers",
                       description="Run two designs over the same scenarios and compare them.")
    p.add_argument("design_a", metavar="DESIGN_A")
    p.add_argument("design_b", metavar="DESIGN_B")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report folder (default {DEFAULT_OUT}/)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    design(args.design_a)
    design(args.design_b)
    mod = need("zerostate.model.compare", "zerostate compare")
    from zerostate.specs import SPECS

    from .report import Report

    result = mod.compare(args.design_a, args.design_b)
    data = result.to_json() if hasattr(result, "to_json") else result
    report = Report(args.out, "compare", {"target": "model", "design": f"{args.design_a} vs {args.design_b}",
                                          "command_line": "zerostate " + " ".join(sys.argv[1:])},
                    columns=[args.design_a, args.design_b], specs=SPECS)
    for sid, row in _spec_rows(data, args.design_a, args.design_b).items():
        for name, holds in row.items():
            report.set_result(sid, name, "holds" if holds else "violated")
    report.finish("complete", data)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(result.to_text() if hasattr(result, "to_text") else str(result))
        print(f"\nReport: {args.out}/report.md")
    return EXIT_OK


def _spec_rows(data: Any, a: str, b: str) -> dict[str, dict[str, bool]]:
    """``{spec: {design: holds}}`` from the comparison's JSON, whichever way round it nests."""
    rows: dict[str, dict[str, bool]] = {}
    specs = data.get("specs", {}) if isinstance(data, dict) else {}
    for sid, v in specs.items():
        if isinstance(v, dict):
            rows[sid] = {n: _holds(v[n]) for n in (a, b) if n in v}
    for n in (a, b):
        per = (data.get("designs", {}).get(n, {}) or {}).get("specs", {}) if isinstance(data, dict) else {}
        for sid, v in per.items():
            rows.setdefault(sid, {})[n] = _holds(v)
    return rows


def _holds(v: Any) -> bool:
    if isinstance(v, dict):
        return bool(v.get("holds", True))
    return v in (True, "holds")


__all__ = ["add_parser", "run"]
