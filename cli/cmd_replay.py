"""``zerostate replay SCENARIO.json``: run one saved scenario; say pass or fail, and why.

A finding file (``finding_<n>.json``: ``{"check", "key", "error", "scenario", "sequence"?}``) is judged
on *its* check: ``FAIL`` (exit 1) when the replay has a finding with the file's ``check``
(the same ``key`` or not: the report says which), ``PASS`` (exit 0) when that check holds; any other
failing check is listed separately and does not change the exit status.  An order-dependent finding's
``sequence`` (the examples that must run first) is run first, in the target's fresh worker.  A plain
scenario file (no ``check``) fails on any finding.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zerostate.cli import targets_api as api
from zerostate.cli.cmd_explore import add_target_options, summary_tag
from zerostate.explorer.gathered import gathered_metrics
from zerostate.findings.finding import Finding
from zerostate.known.labels import label
from zerostate.model.scenario import Scenario, ScenarioError

from zerostate.cli.common import EXIT_FINDINGS, EXIT_OK, CliError, check_world_size, design, load_scenario, positive_int


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="run one saved scenario (a finding_<n>.json or scenario file)",
                       description="Run one saved scenario on a target and say pass or fail with the reason.")
    p.add_argument("scenario", metavar="SCENARIO.json")
    add_target_options(p)
    p.add_argument("--repeat", type=positive_int, default=None, metavar="N",
                   help="run the scenario up to N times in one worker, failing on the first run with the "
                        "finding's check (an intermittent finding's file sets it; default 1)")
    p.add_argument("--ablate", action="store_true",
                   help="then replay the scenario without each of its triggers in turn (a second backward, a "
                        "between-step event, each training-setup dimension), each in a fresh worker, and show "
                        "what each leaves: evidence beside an unexplained finding, never its label")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.add_argument("--out", metavar="DIR", help="also write a report folder (with a repro script when it fails)")
    p.set_defaults(run=run)


def _finding_file(path: str) -> tuple[str | None, str | None, list[Scenario], int]:
    """The finding's ``check``, ``key``, ``sequence`` and ``repeat`` (none for a plain scenario file)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None, None, [], 1
    if not isinstance(data, dict) or "scenario" not in data:
        return None, None, [], 1
    repeat = data.get("repeat", 1)
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise CliError(f"{path}: repeat: expected a positive integer, got {repeat!r}")
    seq = data.get("sequence") or []
    if not isinstance(seq, list):
        raise CliError(f"{path}: sequence: expected a list of scenarios, got {type(seq).__name__}")
    out = []
    for i, d in enumerate(seq):
        try:
            out.append(Scenario.from_dict(d))
        except ScenarioError as exc:
            raise CliError(f"{path}: sequence[{i}]: {exc}") from None
    check = data.get("check") if isinstance(data.get("check"), str) else None
    key = data.get("key") if isinstance(data.get("key"), str) else None
    return check, key, out, repeat


def _first(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    want, key, sequence, repeat = _finding_file(args.scenario)
    repeat = args.repeat or repeat
    check_world_size(args.world_size)
    if args.target == "model" and args.design:
        design(args.design)
    target = api.target(args)
    target_info = api.describe_target(target)
    try:
        for sc in sequence:  # an order-dependent finding: what ran before it, in this fresh worker
            api.run_scenario(target, sc)
        ran = 0
        while ran < repeat:  # an intermittent finding (a race): until its check shows
            ran += 1
            outcome = api.run_scenario(target, scenario)
            if any(f.check == want if want else True for f in api.findings(outcome)):
                break
    finally:
        api.close(target)
    found = api.findings(outcome)
    if want is None:
        passed, check, error = api.outcome(outcome)
        this, others = ([found[0]] if found else []), found[1:]
    else:
        this = [f for f in found if f.check == want]
        this.sort(key=lambda f: f.key != key)  # the same key first
        others = [f for f in found if f.check != want]
        passed = not this
        check, error = (want, this[0].error) if this else (None, "")
    same_key = bool(this) and key is not None and this[0].key == key
    known = label(this[0]) if this else None  # by the replay's own evidence, as explore labels its findings
    ablated = _ablate(args, scenario) if args.ablate else None
    if args.out:
        _report(args, target_info, outcome)
    where = (f"model design {target_info['design']}" if args.target == "model"
             else f"DeepSpeed {target_info['deepspeed']}")
    other = [{"check": f.check, "error": _first(f.error)} for f in others]
    ran_first = f" (after the {len(sequence)} example(s) of its sequence)" if sequence else ""
    if repeat > 1:
        ran_first += f" (run {ran} of up to {repeat})"
    if args.json:
        print(json.dumps({**target_info, "scenario": scenario.to_dict(), "passed": passed, "check": check,
                          "error": error, "key": this[0].key if this else None,
                          "finding_check": want, "finding_key": key,
                          "same_key": same_key if want else None, "sequence": len(sequence), "runs": ran,
                          "known_issue": known, "other_failing_checks": other,
                          "gathered": gathered_metrics(scenario, outcome),
                          **({"ablations": ablated} if ablated is not None else {})}, indent=2))
    elif passed:
        what = (f"the finding's check {want} holds{ran_first}" if want else
                "every spec holds and the PyTorch oracle agrees")
        print(f"PASS on {where}: {what}\n{scenario.describe()}")
    else:
        lines = [ln for ln in error.strip().splitlines() if ln.strip()]
        tag = ""
        if want:
            tag = (" (the finding reproduced" + ("" if same_key or key is None else
                                                  ", same check but another message shape than the finding's")
                   + f"){ran_first}")
        tag += _label_tag(this[0], known) if this else ""
        print(f"FAIL on {where}: {check}: {lines[0] if lines else ''}{tag}\n{scenario.describe()}")
        if len(lines) > 1:
            print("details:\n  " + "\n  ".join(lines[1:12]) + ("\n  ..." if len(lines) > 12 else ""))
    if other and not args.json:
        print("other failing checks (not the finding's; they do not change the exit status):" if want else
              "other failing checks:")
        for o in other:
            print(f"  {o['check']}: {o['error']}")
    if ablated is not None and not args.json:
        _print_ablations(ablated)
    return EXIT_OK if passed else EXIT_FINDINGS


def _ablate(args: argparse.Namespace, scenario: Scenario) -> list[dict[str, Any]]:
    """Each ablation of ``scenario`` (`explorer.ablate`) in a fresh worker: what it changed and the findings
    it gives, each with the known issue its own evidence shows (None: unexplained)."""
    from zerostate.explorer.ablate import ablations
    from zerostate.known.labels import issue_of
    rows = []
    for what, sc in ablations(scenario):
        target = api.target(args)
        try:
            found = api.findings(api.run_scenario(target, sc))
        finally:
            api.close(target)
        rows.append({"change": what, "scenario": sc.to_dict(),
                     "findings": [{"key": f.key, "check": f.check,
                                   "known_issue": k.id if f.deepspeed and (k := issue_of(f)) else None}
                                  for f in found]})
    return rows


def _label_tag(f: Finding, known: dict[str, Any] | None) -> str:
    """What the replay's own evidence says of a DeepSpeed finding, as explore's summary line says it, or that
    nothing known explains it (a model design's findings have no known issues)."""
    from zerostate.findings.harness import harness_error
    if not f.deepspeed:
        return ""
    return summary_tag({"harness_error": harness_error(f), "known_issue": known}) or " [no known issue explains it]"


def _print_ablations(rows: list[dict[str, Any]]) -> None:
    print(f"ablations ({len(rows)}, each replayed alone in a fresh worker; evidence, not a label):")
    for r in rows:
        found = ", ".join(f"{f['key']} [{f['known_issue'] or 'unexplained'}]" for f in r["findings"]) or "no finding"
        print(f"  {r['change']}: {found}")


def _report(args: argparse.Namespace, target_info: dict[str, Any], outcome: Any) -> None:
    from zerostate.specs import SPECS

    from zerostate.cli.cmd_explore import _replay_args, column_of, shown
    from zerostate.reports.report_folder import Report

    column = column_of(args, target_info)
    report = Report(args.out, "replay", {**target_info, "command_line": "zerostate " + " ".join(sys.argv[1:])},
                    columns=[column], specs=SPECS, replay_args=_replay_args(args))
    for f in api.findings(outcome):
        report.add_finding(f, column=column, **shown(f, target_info))
    for sid in SPECS:
        if report.model.specs[sid].results[column] == "not checked":
            report.set_result(sid, column, "ok")
    report.finish("complete")


__all__ = ["add_parser", "run"]
