"""``zerostate bisect SCENARIO.json --from V1 --to V2``: the first release where the outcome changes."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace
from typing import Any

from . import targets_api as api
from .common import EXIT_FINDINGS, EXIT_OK, load_scenario
from .releases import available_releases, release_range


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bisect", help="first DeepSpeed release in a range where a scenario's outcome changes",
                       description="Binary search over DeepSpeed releases (installed as needed) for the first "
                                   "release where the scenario's outcome flips: first bad or first fixed.")
    p.add_argument("scenario", metavar="SCENARIO.json")
    p.add_argument("--from", dest="lo", required=True, metavar="V1", help="older release")
    p.add_argument("--to", dest="hi", required=True, metavar="V2", help="newer release")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    releases = release_range(args.lo, args.hi, available_releases())
    tried: dict[str, dict[str, Any]] = {}

    def outcome(i: int) -> bool:
        v = releases[i]
        if v not in tried:
            t = api.target(SimpleNamespace(target="deepspeed", design=None, deepspeed=v, deepspeed_path=None,
                                           world_size=1, check_release=False))
            try:
                passed, check, error = api.outcome(api.run_scenario(t, scenario))
            finally:
                api.close(t)
            tried[v] = {"release": v, "passed": passed, "check": check, "error": error}
            if not args.json:
                print(f"  {v:<8} {'pass' if passed else 'FAIL ' + str(check) + ': ' + _first(error)}", flush=True)
        return tried[v]["passed"]

    if not args.json:
        print(f"bisect over {len(releases)} release(s), {releases[0]} .. {releases[-1]}:")
    lo, hi = 0, len(releases) - 1
    end = outcome(hi)
    if outcome(lo) == end:
        verdict = {"kind": None, "release": None,
                   "message": f"same outcome ({'pass' if end else 'fail'}) at {releases[lo]} and {releases[hi]}: "
                              "nothing to bisect"}
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if outcome(mid) == end:
                hi = mid
            else:
                lo = mid
        kind = "first fixed" if end else "first bad"
        verdict = {"kind": kind, "release": releases[hi],
                   "message": f"{kind}: {releases[hi]} (previous release {releases[lo]} "
                              f"{'fails' if end else 'passes'})"}
    if args.json:
        print(json.dumps({**verdict, "from": args.lo, "to": args.hi, "tried": list(tried.values())}, indent=2))
    else:
        print(verdict["message"])
    return EXIT_OK if verdict["release"] else EXIT_FINDINGS


def _first(text: str) -> str:
    return text.strip().splitlines()[0][:160] if text and text.strip() else ""


__all__ = ["add_parser", "run"]
