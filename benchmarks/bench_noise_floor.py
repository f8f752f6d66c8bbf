"""The oracle's noise floor: how far a correct DeepSpeed's update is from PyTorch's, per dtype and world size.

    python benchmarks/bench_noise_floor.py [--examples 500] [--seed 7] [--json OUT.json]

The scenarios of one exploration sequence (a seed other than the default one, so the tolerance is not set on the
rows the default exploration reports) run on the installed DeepSpeed.  For every run with no finding at all, and
every step and parameter, the error of DeepSpeed's update against PyTorch's beyond the `tolerance.ULPS` floor is
taken as a share of PyTorch's update (max element over max element), per comparison: fp32 parameters, 16-bit
parameters, and the fp32 master weights of bf16 and fp16, at world size 1 and above it.  The table gives the
largest share seen and the `tolerance.UPDATE_RTOL` the oracle uses: each tolerance is a few times that noise and
below the errors a bug makes (a tenth of an update and more: test_oracle_tolerance.py injects them).  In mixed
precision a second figure takes each element's error beyond `tolerance.NOISE_TIMES` its measured noise (what the
oracle judges: `ParamStep.update_excess_max`).  Runs with findings are left out (a bug is no noise); their count is
printed.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time

import zerostate.targets  # noqa: F401 -- registers the target kinds
from zerostate.explorer.generate import generated
from zerostate.explorer.strategies import scenarios
from zerostate.findings.oracle_judgement import ulp
from zerostate.findings.tolerance import ULPS, UPDATE_RTOL
from zerostate.targets.interface import get_target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=500)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    distinct = list(dict.fromkeys(generated(scenarios(), args.examples, args.seed)))
    worst: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    worst_net: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    samples: collections.Counter[tuple[str, str, str]] = collections.Counter()
    clean = with_findings = skipped = 0
    t = get_target("deepspeed")
    t0 = time.perf_counter()
    try:
        for sc in distinct:
            out = t.run(sc)
            if out.record is None or out.skipped:
                skipped += 1
                continue
            if out.findings:
                with_findings += 1
                continue
            clean += 1
            prec = sc.precision.value
            ranks = "world size 1" if sc.world_size == 1 else "world size > 1"
            for s in out.record.steps:
                for kind, params in (("params", s.params), ("master", s.masters or ())):
                    for p in params:
                        if p.update_err_max is None or p.update_max <= 0:
                            continue
                        what = "fp32 params" if kind == "params" and prec == "fp32" else \
                            f"{prec} params" if kind == "params" else f"{prec} master weights"
                        floor = ULPS * ulp(p.dtype, max(p.want_max, p.err_max))
                        key = (what, ranks, prec)
                        samples[key] += 1
                        worst[key] = max(worst[key], (p.update_err_max - floor) / p.update_max)
                        net = p.update_excess_max if p.update_excess_max is not None else p.update_err_max
                        worst_net[key] = max(worst_net[key], (net - floor) / p.update_max)
    finally:
        t.close()
    seconds = time.perf_counter() - t0
    print(f"{len(distinct)} distinct scenarios (seed {args.seed}): {clean} clean runs measured, {with_findings} with "
          f"findings left out, {skipped} skipped; {seconds:.0f} s")
    print()
    print("| comparison | ranks | samples | largest error beyond the floor, share of PyTorch's update | "
          "the same beyond the measured noise (what is judged) | tolerance |")
    print("|---|---|---|---|---|---|")
    rows = []
    for (what, ranks, prec), n in sorted(samples.items()):
        kind = "params" if what.endswith("params") else "master"
        key = (kind, "fp32" if what == "fp32 params" else "mixed") if kind == "params" else (kind, prec)
        tol = UPDATE_RTOL[key][0 if ranks == "world size 1" else 1]
        w, judged = worst[(what, ranks, prec)], worst_net[(what, ranks, prec)]
        rows.append({"comparison": what, "ranks": ranks, "samples": n, "worst": w, "judged": judged,
                     "tolerance": tol})
        print(f"| {what} | {ranks} | {n} | {max(w, 0.0):.2g} | {max(judged, 0.0):.2g} | {tol:g} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"seed": args.seed, "clean": clean, "with_findings": with_findings, "rows": rows}, fh, indent=1)
    return 0 if all(r["judged"] <= r["tolerance"] or math.isclose(r["judged"], r["tolerance"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
