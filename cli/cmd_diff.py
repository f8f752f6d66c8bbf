"""``zerostate diff --base REL|PATH --head REL|PATH``: one exploration on two DeepSpeed builds, side by side.

For a pull request: the same exploration (same seed, same example budget, so the same generated scenario
sequence) runs on the base build and on the head build (a release, installed as needed, or a checkout,
e.g. the pull request's tree).  Every finding is then classified by replaying its shrunk scenario on the
other build:

* **fixed**: found on base; the head replay does not show it (same finding key, or same root cause:
  `targets.grouping.group_key`);
* **introduced**: found on head; the base replay does not show it;
* **unmasked**: found on head; the base replay does not show it because it stopped earlier (DeepSpeed
  raised) or another bug changed its course (the base replay has another finding), and a known issue
  affecting the base release explains it -- an existing bug that a fix lets the run reach (e.g. fixing
  ``z3-leaf-input-without-grad`` reveals ``z3-leaf-kept-gathered``; 0.19.3's release of backward
  leftovers reveals ``z3-leaf-input-without-grad``'s unavailable parameters, which 0.19.2's
  still-gathered leak kept gathered); reported, not counted as introduced;
* **unchanged**: both show it (whichever exploration found it).

Each keeps the other side's replay as evidence.  The scenarios both explorations ran to the end are
compared for real gathered-parameter memory and all-gathers (`diff_metrics`), per scenario family.
Exit status 1 when head introduces a finding or raises the gathered-parameter peak of some scenario
beyond ``--memory-tolerance`` (default 10 %); 0 otherwise; 2 bad input; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

from zerostate.cli import targets_api as api
from zerostate.cli.common import EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_OK, CliError, check_world_size, load_scenario, \
    non_negative_float, positive_int
from zerostate.cli.cmd_explore import _ctrl_c_kept, _kept
from zerostate.cli.progress import Progress

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
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks: 1 (default) or 2")
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
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report folder (default {DEFAULT_OUT}/)")
    p.set_defaults(run=run)


class _OutOfTime(KeyboardInterrupt):
    pass


class Recorder:
    """A target whose runs are memoised by scenario and whose finished ZeRO-3 runs are measured."""

    def __init__(self, target: Any):
        self.target = target
        self.name = getattr(target, "name", "deepspeed")
        self.version = getattr(target, "version", None)
        self.outcomes: dict[str, Any] = {}
        self.measured: dict[str, dict[str, int]] = {}

    def run(self, sc: Any) -> Any:
        from zerostate.cli.diff_metrics import metrics
        key = sc.to_json(None)
        if key not in self.outcomes:
            out = self.target.run(sc)
            self.outcomes[key] = out
            if sc.stage == 3 and not out.error and out.trace and not any(
                    f.check in ("hang", "crash", "internal") for f in out.findings):
                self.measured[key] = metrics(sc, out.trace)
        return self.outcomes[key]

    def close(self) -> None:
        api.close(self.target)


def build(spec: str, option: str, world_size: int) -> tuple[Any, str]:
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


def explore_side(rec: Recorder, label: str, args: argparse.Namespace, ctrl_c: Any) -> tuple[list[Any], str]:
    progress = Progress(f"diff {label}")
    found: list[Any] = []
    by_key: dict[str, int] = {}

    def keep(f: Any) -> None:
        """explore hands each finding over unshrunk first, then its final (shrunk) finding: keep the last."""
        key = getattr(f, "key", None)
        if key in by_key:
            found[by_key[key]] = f
        else:
            by_key[key] = len(found)
            found.append(f)
    t0 = time.monotonic()
    stop = {"done": False}

    def on_progress(examples: int, *_: Any, **__: Any) -> None:
        progress.update(examples, len(found))
        if args.time_budget and time.monotonic() - t0 > args.time_budget and not stop["done"]:
            stop["done"] = True
            raise _OutOfTime()

    status = "complete"
    try:
        api.explore(rec, args.examples, args.seed, keep, _kept(ctrl_c, on_progress), on_update=keep)
    except _OutOfTime:
        status = "time budget spent"
    finally:
        progress.close()
    return found, status


def classify(base_found: list[Any], head_found: list[Any], base: Recorder, head: Recorder) -> list[dict[str, Any]]:
    from zerostate.known.labels import group_key
    entries: list[dict[str, Any]] = []
    matched: set[str] = set()
    for fb in base_found:
        out = head.run(fb.scenario)
        same = [g for g in out.findings if g.key == fb.key or group_key(g) == group_key(fb)]
        matched.update(g.key for g in same)
        entries.append(_entry("unchanged" if same else "fixed", fb, "base", out))
    base_keys = {f.key for f in base_found}
    for fh in head_found:
        if fh.key in base_keys or fh.key in matched:
            continue
        out = base.run(fh.scenario)
        same = [g for g in out.findings if g.key == fh.key or group_key(g) == group_key(fh)]
        masked = bool(out.error or out.findings)  # the base run raised, or another bug changed its course
        status = "unchanged" if same else "unmasked" if _known_on(fh, base.version) and masked else "introduced"
        entries.append(_entry(status, fh, "head", out))
    order = {"introduced": 0, "fixed": 1, "unmasked": 2, "unchanged": 3}
    entries.sort(key=lambda e: order[e["status"]])
    for n, e in enumerate(entries, 1):
        e["n"] = n
    return entries


def _known_on(f: Any, version: str | None) -> bool:
    """A known issue explains ``f`` as it would be on ``version`` (the base release)."""
    from dataclasses import replace

    from zerostate.known.labels import label
    return bool(version) and label(replace(f, deepspeed=version)) is not None


def _entry(status: str, f: Any, side: str, other: Any) -> dict[str, Any]:
    from zerostate.known.labels import annotate
    return {"status": status, "found_on": side, "check": f.check, "key": f.key, "error": f.error,
            "scenario": f.scenario.to_dict(), "description": f.scenario.describe(), **annotate(f),
            "replay_on_" + ("head" if side == "base" else "base"): _replay_summary(other)}


def _replay_summary(out: Any) -> dict[str, Any]:
    lines = (out.error or "").strip().splitlines()
    return {"clean": not out.findings, "error": lines[-1][:300] if lines else None,
            "findings": [{"check": g.check, "key": g.key, "error": _first(g.error)} for g in out.findings]}


def _first(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text and text.strip() else ""


def run(args: argparse.Namespace) -> int:
    from zerostate.cli.diff_metrics import compare
    from zerostate.cli.diff_report import write_report
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
    common = [k for k in base.measured if k in head.measured]
    from zerostate.model.scenario import Scenario
    pairs = [(Scenario.from_json(k), base.measured[k], head.measured[k]) for k in common]
    memory = compare(pairs, args.memory_tolerance)
    counts = {s: sum(e["status"] == s for e in entries) for s in ("fixed", "introduced", "unmasked", "unchanged")}
    result = {"base": {"spec": args.base, "name": base_name, "deepspeed": base.version, "runs": len(base.outcomes),
                       "exploration": st_b},
              "head": {"spec": args.head, "name": head_name, "deepspeed": head.version, "runs": len(head.outcomes),
                       "exploration": st_h},
              "status": status, "examples": args.examples, "scenarios": list(args.scenario), "seed": args.seed, "world_size": args.world_size,
              "seconds": round(time.monotonic() - t0, 1), "counts": counts, "findings": entries,
              "memory": memory, "command_line": "zerostate " + " ".join(sys.argv[1:])}
    regress = bool(memory["regressions"])
    result["verdict"] = ("interrupted" if status != "complete" else
                         "head introduces findings" if counts["introduced"] else
                         "head regresses gathered-parameter memory" if regress else "no regression")
    write_report(args.out, result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"diff {base_name} -> {head_name}: {counts['fixed']} fixed, {counts['introduced']} introduced, "
              f"{counts['unmasked']} unmasked, {counts['unchanged']} unchanged; {len(pairs)} ZeRO-3 scenario(s) compared, "
              f"{len(memory['regressions'])} memory regression(s) beyond {args.memory_tolerance:.0%}; "
              f"{result['seconds']:.0f}s. Report: {args.out}/diff.md")
        for e in entries:
            known = f" [{e['known_issue']['id']}]" if e.get("known_issue") else ""
            print(f"  {e['status']:<10} {e['check']}: {_first(e['error'])[:120]}{known}")
    if status != "complete":
        return EXIT_INTERRUPTED
    return EXIT_FINDINGS if counts["introduced"] or regress else EXIT_OK


__all__ = ["DEFAULT_OUT", "Recorder", "add_parser", "classify", "run"]
