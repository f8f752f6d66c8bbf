"""Record each known issue's fingerprints from its own repros: known/fingerprints.json.

    python tools/record_fingerprints.py [--releases 0.19.8,0.19.2] [--issues ID,ID]
    python tools/record_fingerprints.py --from-report zerostate-report/report.json --releases 0.19.8
    python tools/record_fingerprints.py --rerecord exception,saved-tensor-intact [--issues ID,ID]

Each issue's scenario and variants run on every given release the issue affects; the fingerprint of each finding
its evidence rule accepts (`KnownIssue.explains`: the exception, the violating events, the parameters involved)
is recorded with the release and the repro that gave it (the scenario itself).  ``--from-report``: the findings
of a report whose label a triage confirmed are more repros of their issue -- each one's scenario is run again,
and a fingerprint the issue's evidence rule accepts is recorded with that scenario as its repro.  An issue stated
by counterfactual mechanisms alone has nothing to record (its oracle findings are labelled by the reference they
match).  Issues not run keep what the file holds.  ``--rerecord CHECKS``: after the fingerprint of those checks
changed, each recorded fingerprint of them is run again from where it was recorded (its release, its repro's
scenario) and replaced by what the run gives now; the file is written only when every one of them reproduced.
``test_known_issue`` checks that each issue's scenario still gives its recorded fingerprints.
"""

from __future__ import annotations

import argparse
import json
import sys

from zerostate.known.issues import KNOWN_ISSUES
from zerostate.known.recorded import FILE
from zerostate.targets.interface import get_target
import zerostate.targets  # noqa: F401 -- registers the target kinds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--releases", default="0.19.8")
    ap.add_argument("--issues", default="")
    ap.add_argument("--from-report", default=None, metavar="REPORT_JSON")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run each repro up to N times in one target until its rule accepts a finding (an "
                         "intermittent issue, a race between ranks)")
    ap.add_argument("--rerecord", default="", metavar="CHECKS",
                    help="run the recorded repros of these checks' fingerprints again and record what they give now")
    args = ap.parse_args(argv)
    wanted = set(filter(None, args.issues.split(",")))
    data = json.loads(FILE.read_text()) if FILE.exists() else {}
    if args.rerecord:
        missing = _rerecord(data, set(args.rerecord.split(",")), wanted, args.repeat)
        if missing:
            print("not reproduced, nothing written:\n  " + "\n  ".join(missing), file=sys.stderr)
            return 1
        FILE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        return 0
    if args.from_report:
        _from_report(data, args.from_report, args.releases.split(",")[0])
        FILE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        return 0
    for release in args.releases.split(","):
        issues = [k for k in KNOWN_ISSUES if k.affects(release) and k.explains is not None
                  and (not wanted or k.id in wanted)]
        import deepspeed
        target = get_target("deepspeed", deepspeed=None if release == deepspeed.__version__ else release)
        try:
            for k in issues:
                entry = data.setdefault(k.id, {"fingerprints": [], "from": {}})
                for i, sc in enumerate((k.scenario, *k.variants)):
                    for run in range(args.repeat):
                        out = target.run(sc.with_(world_size=max(sc.world_size, k.world_size)))
                        accepted = [f for f in out.findings if k.explains(f)]
                        for f in accepted:
                            if f.key not in entry["fingerprints"]:
                                entry["fingerprints"].append(f.key)
                                entry["from"][f.key] = {"release": release, "repro": "scenario" if i == 0 else
                                                        f"variant {i}", "scenario": sc.to_dict(),
                                                        **({"run": run + 1} if args.repeat > 1 else {})}
                        if accepted:
                            break
                print(f"{release} {k.id}: {len(entry['fingerprints'])} fingerprint(s)", file=sys.stderr)
        finally:
            target.close()
    FILE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


def _from_report(data: dict, path: str, release: str) -> None:
    from zerostate.known.issues import by_id
    from zerostate.model.scenario import Scenario
    import deepspeed
    with open(path) as fh:
        report = json.load(fh)
    target = get_target("deepspeed", deepspeed=None if release == deepspeed.__version__ else release)
    try:
        for entry in report["findings"]:
            issue = by_id((entry.get("known_issue") or {}).get("id") or "")
            if issue is None or issue.explains is None:
                continue
            sc = Scenario.from_dict(entry["scenario"])
            for f in target.run(sc).findings:
                rec = data.setdefault(issue.id, {"fingerprints": [], "from": {}})
                if issue.explains(f) and f.key not in rec["fingerprints"]:
                    rec["fingerprints"].append(f.key)
                    rec["from"][f.key] = {"release": release, "repro": f"report finding {entry['n']}",
                                          "scenario": sc.to_dict()}
                    print(f"{release} {issue.id}: + {f.key[:120]}", file=sys.stderr)
    finally:
        target.close()


def _rerecord(data: dict, checks: set[str], wanted: set[str], repeat: int) -> list[str]:
    """Replace each recorded fingerprint of ``checks`` by what its repro gives now; the ones that gave nothing the
    issue's rule accepts with that check (``data`` then unchanged for them: the caller writes nothing)."""
    from zerostate.known.issues import by_id
    from zerostate.model.scenario import Scenario
    import deepspeed
    todo: dict[str, list[tuple[str, str, dict]]] = {}
    for issue_id, entry in data.items():
        if wanted and issue_id not in wanted:
            continue
        for fp, where in entry["from"].items():
            if fp.split(":", 1)[0] in checks:
                todo.setdefault(where["release"], []).append((issue_id, fp, where))
    missing: list[str] = []
    for release, items in sorted(todo.items()):
        target = get_target("deepspeed", deepspeed=None if release == deepspeed.__version__ else release)
        try:
            for issue_id, old, where in items:
                issue, sc = by_id(issue_id), Scenario.from_dict(where["scenario"])
                check = old.split(":", 1)[0]
                issue_ws = issue.world_size if issue is not None else 1
                got: list[str] = []
                for _ in range(repeat):
                    out = target.run(sc.with_(world_size=max(sc.world_size, issue_ws)))
                    got = [f.key for f in out.findings if f.check == check and issue is not None and issue.explains(f)]
                    if got:
                        break
                if not got:
                    missing.append(f"{release} {issue_id}: {old}")
                    continue
                entry = data[issue_id]
                entry["fingerprints"].remove(old)
                del entry["from"][old]
                for key in got:
                    if key not in entry["from"]:
                        entry["fingerprints"].append(key)
                        entry["from"][key] = where
                print(f"{release} {issue_id}: {old[:80]} -> {', '.join(k[-40:] for k in got)}", file=sys.stderr)
        finally:
            target.close()
    return missing


if __name__ == "__main__":
    sys.exit(main())
