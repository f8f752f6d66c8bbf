"""Record each known issue's fingerprints from its own repros: known/fingerprints.json.

    python tools/record_fingerprints.py [--releases 0.19.8,0.19.2] [--issues ID,ID]

Each issue's scenario and variants run on every given release the issue affects; the fingerprint of each finding
its evidence rule accepts (`KnownIssue.explains`: the exception, the violating events, the parameters involved)
is recorded with the release and the repro that gave it.  An issue stated by counterfactual mechanisms alone has
nothing to record (its oracle findings are labelled by the reference they match).  Issues not run keep what the
file holds.  ``test_known_issue`` checks that each issue's scenario still gives its recorded fingerprints.
"""

from __future__ import annotations

import argparse
import json
import sys

from zerostate.known.issues import KNOWN_ISSUES
from zerostate.known.recorded import FILE
from zerostate.targets.base import get_target
import zerostate.targets  # noqa: F401 -- registers the target kinds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--releases", default="0.19.8")
    ap.add_argument("--issues", default="")
    args = ap.parse_args(argv)
    wanted = set(filter(None, args.issues.split(",")))
    data = json.loads(FILE.read_text()) if FILE.exists() else {}
    for release in args.releases.split(","):
        issues = [k for k in KNOWN_ISSUES if k.affects(release) and k.explains is not None
                  and (not wanted or k.id in wanted)]
        import deepspeed
        target = get_target("deepspeed", deepspeed=None if release == deepspeed.__version__ else release)
        try:
            for k in issues:
                entry = data.setdefault(k.id, {"fingerprints": [], "from": {}})
                for i, sc in enumerate((k.scenario, *k.variants)):
                    out = target.run(sc)
                    for f in out.findings:
                        if k.explains(f) and f.key not in entry["fingerprints"]:
                            entry["fingerprints"].append(f.key)
                            entry["from"][f.key] = {"release": release, "repro": "scenario" if i == 0 else
                                                    f"variant {i}"}
                print(f"{release} {k.id}: {len(entry['fingerprints'])} fingerprint(s)", file=sys.stderr)
        finally:
            target.close()
    FILE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
