"""Model-checking benchmark: states explored per second, and the time of `zerostate check`'s default bound.

Run: ``.venv/bin/python benchmarks/bench_model_check.py [--jobs N] [--json OUT]``.

It measures, in one run:

1. single-process throughput: reachable states (and transitions) per second of
   `explore.state_graph` for each design over a fixed sample of scenarios from the
   default bound (hook specs on the hook DAG, coordinator specs on the full DAG);
2. wall time of the default `check` bound for every design (``jobs`` processes),
   and of the full 3-block bound the issue names, when ``--full`` is given.

Figures go to README's benchmark table; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

from zerostate.analysis.checker import Bound, canonical, check
from zerostate.model.designs import designs
from zerostate.model.explore import state_graph
from zerostate.specs import SPECS


def throughput(sample_size: int = 150, seed: int = 0) -> dict:
    reps = list(dict.fromkeys(canonical(s) for s in Bound().scenarios()))
    rnd = random.Random(seed)
    sample = rnd.sample(reps, min(sample_size, len(reps)))
    hook = [s for s in SPECS.values() if s.family == "hooks"]
    coord = [s for s in SPECS.values() if s.family == "coordinator"]
    out = {}
    for name, d in designs().items():
        states = transitions = 0
        t0 = time.perf_counter()
        for sc in sample:
            g = state_graph(d, sc, hook, coordinator=False)
            states += g.states
            transitions += g.transitions
            if coord and sc.stage == 3 and getattr(d.coordinator, "name", "none") != "none":
                g = state_graph(d, sc, coord, coordinator=True)
                states += g.states
                transitions += g.transitions
        dt = time.perf_counter() - t0
        out[name] = {"scenarios": len(sample), "states": states, "transitions": transitions,
                     "seconds": round(dt, 3), "states_per_second": round(states / dt),
                     "transitions_per_second": round(transitions / dt)}
    return out


def timed_check(bound: Bound, jobs: int) -> dict:
    t0 = time.perf_counter()
    res = check(list(designs()), bound, jobs=jobs)
    return {"seconds": round(time.perf_counter() - t0, 2), "scenarios": len(list(bound.scenarios())),
            "states": sum(d.states for d in res.designs.values()), "ok": res.ok}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--full", action="store_true", help="also time the full 3-block, 2-micro-step bound")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "throughput": throughput(), "default_check": timed_check(Bound(), args.jobs)}
    if args.full:
        result["full_check"] = timed_check(Bound(max_blocks=3, max_micro_steps=2), args.jobs)
    print(f"{'design':<12} {'states/s':>10} {'transitions/s':>14}")
    for name, r in result["throughput"].items():
        print(f"{name:<12} {r['states_per_second']:>10} {r['transitions_per_second']:>14}")
    for key in ("default_check", "full_check"):
        if key in result:
            r = result[key]
            print(f"{key}: {r['scenarios']} scenarios, {r['states']} states, {r['seconds']} s "
                  f"({args.jobs} processes), ok={r['ok']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
