"""``zerostate bisect SCENARIO.json --from V1 --to V2``: the first release where the outcome changes.

The outcome of a release is what kind of failure the scenario shows there (`outcome_of`): ``pass``, or
any of ``crash`` (DeepSpeed raised, the worker died or hung), ``violation`` (a spec is violated on the real
trace) and ``oracle difference`` (parameters differ from plain PyTorch's), joined with ``+``.  A change
from one failure kind to another (a crash that becomes a silent violation) is a change too.  A
disagreement with zerostate's model is the model's business, not the release's: it is not an outcome.

Default: a binary search for the first release whose outcome differs from ``--from``'s (one change in the
range is assumed).  ``--both``: the first bad *and* the first fixed release: with ``--bad V`` (a release
known to fail in the range) two binary searches, [from, V] and [V, to]; without it every release of the
range is run and every change reported.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace
from typing import Any
from collections.abc import Callable

from zerostate.cli import targets_api as api
from zerostate.cli.common import EXIT_FINDINGS, EXIT_OK, CliError, load_scenario
from zerostate.cli.releases import available_releases, release_range

PASS = "pass"
_CRASH = frozenset({"exception", "crash", "hang", "internal"})


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bisect", help="first DeepSpeed release in a range where a scenario's outcome changes",
                       description="Binary search over DeepSpeed releases (installed as needed) for the first "
                                   "release where the scenario's outcome (pass, crash, violation, oracle "
                                   "difference) changes: first bad, first fixed, or both (--both).")
    p.add_argument("scenario", metavar="SCENARIO.json")
    p.add_argument("--from", dest="lo", required=True, metavar="V1", help="older release")
    p.add_argument("--to", dest="hi", required=True, metavar="V2", help="newer release")
    p.add_argument("--both", action="store_true", help="report the first bad and the first fixed release")
    p.add_argument("--bad", metavar="V", help="with --both: a release in the range known to fail (two binary "
                                             "searches instead of running every release)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def outcome_of(findings: list[Any]) -> str:
    """``pass`` or the failure kinds of one run, e.g. ``crash + violation``."""
    kinds = set()
    for f in findings:
        check = f.check
        if check == "model-agreement":
            continue
        kinds.add("crash" if check in _CRASH else "oracle difference" if check == "oracle" else "violation")
    return " + ".join(sorted(kinds)) if kinds else PASS


def first_change(outcome: Callable[[int], str], lo: int, hi: int) -> int | None:
    """The first index in (lo, hi] whose outcome differs from lo's, assuming one change; None if hi's is
    the same as lo's."""
    start = outcome(lo)
    if outcome(hi) == start:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if outcome(mid) == start:
            lo = mid
        else:
            hi = mid
    return hi


def kind_of(before: str, after: str) -> str:
    return "first bad" if before == PASS else "first fixed" if after == PASS else "outcome changed"


def transitions(releases: list[str], outcome: Callable[[int], str], both: bool, bad: int | None) -> list[dict]:
    """Every change found, as ``{"kind", "release", "previous", "from", "to"}``."""
    def change(i: int) -> dict:
        return {"kind": kind_of(outcome(i - 1), outcome(i)), "release": releases[i], "previous": releases[i - 1],
                "from": outcome(i - 1), "to": outcome(i)}

    last = len(releases) - 1
    if not both:
        i = first_change(outcome, 0, last)
        return [] if i is None else [change(i)]
    if bad is not None:
        if outcome(bad) == PASS:
            raise CliError(f"--bad {releases[bad]}: the scenario passes on that release")
        found = [first_change(outcome, 0, bad), first_change(outcome, bad, last)]
        return [change(i) for i in found if i is not None]
    return [change(i) for i in range(1, last + 1) if outcome(i) != outcome(i - 1)]


def run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    releases = release_range(args.lo, args.hi, available_releases())
    if args.bad and not args.both:
        raise CliError("--bad V only applies with --both")
    if args.bad and args.bad not in releases:
        raise CliError(f"--bad {args.bad}: not a release between --from {args.lo} and --to {args.hi}")
    tried: dict[str, dict[str, Any]] = {}

    def outcome(i: int) -> str:
        v = releases[i]
        if v not in tried:
            t = api.target(SimpleNamespace(target="deepspeed", design=None, deepspeed=v, deepspeed_path=None,
                                           world_size=1, check_release=False))
            try:
                found = api.findings(api.run_scenario(t, scenario))
            finally:
                api.close(t)
            res = outcome_of(found)
            first = next((f for f in found if f.check != "model-agreement"), None)
            tried[v] = {"release": v, "outcome": res, "passed": res == PASS,
                        "check": first.check if first is not None else None,
                        "error": first.error if first is not None else ""}
            if not args.json:
                print(f"  {v:<8} {'pass' if res == PASS else 'FAIL ' + res + ' (' + str(tried[v]['check']) + '): '}"
                      f"{'' if res == PASS else _first(tried[v]['error'])}", flush=True)
        return tried[v]["outcome"]

    if not args.json:
        print(f"bisect over {len(releases)} release(s), {releases[0]} .. {releases[-1]}"
              f"{' (every release: --both without --bad)' if args.both and not args.bad else ''}:")
    if not args.both:
        outcome(len(releases) - 1)  # the newer end first: what the user cares about
    changes = transitions(releases, outcome, args.both, releases.index(args.bad) if args.bad else None)
    if changes:
        msgs = [f"{c['kind']}: {c['release']} (previous release {c['previous']} "
                f"{'fails' if c['from'] != PASS and c['to'] == PASS else 'passes' if c['from'] == PASS else c['from']}"
                f"{'' if c['kind'] != 'outcome changed' else ', now ' + c['to']})" for c in changes]
        verdict = {"kind": changes[0]["kind"], "release": changes[0]["release"], "message": "\n".join(msgs)}
    else:
        ends = {outcome(0), outcome(len(releases) - 1)}
        verdict = {"kind": None, "release": None,
                   "message": f"same outcome ({' / '.join(sorted(ends))}) at {releases[0]} and {releases[-1]}"
                              f"{' and every release between' if args.both and not args.bad else ''}: "
                              "nothing to bisect"}
    verdict["first_bad"] = next((c["release"] for c in changes if c["kind"] == "first bad"), None)
    verdict["first_fixed"] = next((c["release"] for c in changes if c["kind"] == "first fixed"), None)
    if args.json:
        print(json.dumps({**verdict, "from": args.lo, "to": args.hi, "changes": changes,
                          "tried": list(tried.values())}, indent=2))
    else:
        print(verdict["message"])
    return EXIT_OK if verdict["release"] else EXIT_FINDINGS


def _first(text: str) -> str:
    return text.strip().splitlines()[0][:160] if text and text.strip() else ""


__all__ = ["PASS", "add_parser", "first_change", "kind_of", "outcome_of", "run", "transitions"]
