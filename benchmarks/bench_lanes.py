"""Lanes per minute: the explorer's lanes run by local workers against the same lanes on a two-node Ray cluster.

    python benchmarks/bench_lanes.py [--kind deepspeed|model] [--examples 12] [--lane 3] [--jobs 2]
        [--probes 5] [--json zerostate-bench/lanes.json]

One exploration (`explorer.exploration.explore`, the derandomized core strategy ``scenarios(setup=False)``: world
size 1 only, no shrinking cost from the setup dimensions' findings; confirmation and polish off, so the time is
the lanes') of ``--examples`` examples cut into lanes of ``--lane`` distinct scenarios, each lane in a freshly
started worker:

* **local** -- ``--jobs`` local workers (`targets.interface.get_target`);
* **cluster** -- ``--jobs`` workers on a local two-node Ray cluster (`cluster.local.LocalCluster`: two node
  processes on this machine, 2 CPUs declared each; `cluster.session.ClusterSession`, a gang of 1 CPU per
  worker), the cluster's own start-up timed apart and not counted.

Both run while the cluster is up (its idle processes load the machine alike), local first unless
``--cluster-first``: on a loaded machine the order matters, so compare both orders.

Lanes per minute = lanes / wall minutes of the exploration (the first worker's start included, as a user waits
for it).  The two runs must hand over the same finding keys (printed; a difference is a bug, not a figure).

The per-lane cluster overhead, from ``--probes`` paired probes on one local and one cluster worker of the same
target:

* **start-up** -- a lane's fresh worker: ``fresh()`` on the cluster worker minus on the local one (seconds);
  and a worker's first start, placement group and actor included, minus a local target's start;
* **transfer** -- one run of a small scenario through the Ray actor (the scenario's JSON out, its `Outcome`
  back) minus the same run on the local worker: median seconds per run, times ``--lane`` runs per lane.

Nothing asserts a time.  On this shared 2-core machine the nodes, their workers and the local run's workers all
share the same two cores: the figures say what the cluster's machinery costs here, not what more machines gain.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _options(kind: str) -> dict[str, Any]:
    return {"design": "zerostate"} if kind == "model" else {}


def lanes_of(strategy: Any, examples: int, lane: int) -> int:
    """How many lanes the exploration cuts its generated sequence into (distinct scenarios / lane, rounded up)."""
    from zerostate.explorer.generate import generated
    distinct = set(generated(strategy, examples, None))
    return math.ceil(len(distinct) / lane)


def _explore(first: Any, spawn: Any, args: argparse.Namespace, strategy: Any) -> dict[str, Any]:
    from zerostate.explorer.exploration import explore
    t0 = time.perf_counter()
    res = explore(first, examples=args.examples, seed=None, strategy=strategy, jobs=args.jobs, spawn=spawn,
                  lane=args.lane, confirm=False, polish=False)
    wall = time.perf_counter() - t0
    return {"seconds": round(wall, 2), "runs": res.examples, "findings": sorted(f.key for f in res.findings)}


def _median_seconds(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probes(local: Any, remote: Any, n: int) -> dict[str, float]:
    """Median seconds of a fresh worker and of one small run, on the local worker and on the cluster one."""
    from zerostate.model.scenario import Scenario
    sc = Scenario.from_dict({"blocks": [{}, {"checkpoint": "non_reentrant"}], "stage": 3, "steps": [{}, {}]})
    local.run(sc)
    remote.run(sc)  # both warm
    out = {"run_local": _median_seconds(lambda: local.run(sc), n),
           "run_cluster": _median_seconds(lambda: remote.run(sc), n)}
    if hasattr(local, "fresh"):
        out["fresh_local"] = _median_seconds(lambda: (local.fresh(), local.run(sc)), n) - out["run_local"]
        out["fresh_cluster"] = _median_seconds(lambda: (remote.fresh(), remote.run(sc)), n) - out["run_cluster"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--kind", choices=("deepspeed", "model"), default="deepspeed",
                    help="the target: the installed DeepSpeed (default) or the model design 'zerostate'")
    ap.add_argument("--examples", type=int, default=12)
    ap.add_argument("--lane", type=int, default=3, help="distinct scenarios per lane (the explorer's is 100)")
    ap.add_argument("--jobs", type=int, default=2, help="workers at once, locally and on the cluster")
    ap.add_argument("--probes", type=int, default=5, help="paired probes for the per-lane overhead")
    ap.add_argument("--cluster-first", action="store_true",
                    help="run the cluster's exploration before the local one (the order effect on a loaded machine)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from zerostate.cluster.ray_api import ClusterUnavailable, require_ray
    try:
        require_ray(local=True)  # before anything imports ray: its loopback mode is read at import
    except ClusterUnavailable as exc:
        print(f"bench_lanes: {exc}", file=sys.stderr)
        return 2
    from zerostate.cluster.local import LocalCluster
    from zerostate.cluster.session import ClusterSession
    from zerostate.explorer.strategies import scenarios
    from zerostate.targets.interface import get_target

    strategy = scenarios(setup=False)
    opts = _options(args.kind)
    lanes = lanes_of(strategy, args.examples, args.lane)
    print(f"{args.kind} target, {args.examples} examples, lanes of {args.lane}: {lanes} lanes, {args.jobs} workers")

    t0 = time.perf_counter()
    with LocalCluster(nodes=2, cpus_per_node=2) as cluster:
        up = time.perf_counter() - t0
        with ClusterSession(cluster.address, kind=args.kind, options=opts, gang=1) as session:
            runs: dict[str, dict[str, Any]] = {}
            for where in (("cluster", "local") if args.cluster_first else ("local", "cluster")):
                if where == "local":
                    runs[where] = _explore(get_target(args.kind, **opts), lambda: get_target(args.kind, **opts),
                                           args, strategy)
                else:
                    runs[where] = _explore(session.target(), session.target, args, strategy)
                print(f"{where + ':':8} {runs[where]['seconds']:.1f} s, {runs[where]['runs']} runs", flush=True)
            local, remote = runs["local"], runs["cluster"]
            print(f"(the cluster started in {up:.1f} s, not counted; both runs with it up)")
            t1 = time.perf_counter()
            here = get_target(args.kind, **opts)
            start_local = time.perf_counter() - t1
            t1 = time.perf_counter()
            there = session.target()
            start_cluster = time.perf_counter() - t1
            try:
                p = probes(here, there, args.probes)
            finally:
                here.close()
                there.close()
    per_lane = {
        "first_start_s": round(start_cluster - start_local, 2),
        "fresh_start_s": round(p["fresh_cluster"] - p["fresh_local"], 2) if "fresh_local" in p else None,
        "transfer_per_run_s": round(p["run_cluster"] - p["run_local"], 4),
        "transfer_per_lane_s": round((p["run_cluster"] - p["run_local"]) * args.lane, 3),
    }
    result = {
        "kind": args.kind, "examples": args.examples, "order": list(runs), "lane": args.lane, "lanes": lanes,
        "jobs": args.jobs,
        "local": {**local, "lanes_per_minute": round(lanes / (local["seconds"] / 60), 2)},
        "cluster": {**remote, "lanes_per_minute": round(lanes / (remote["seconds"] / 60), 2),
                    "cluster_start_s": round(up, 2)},
        "same_findings": local["findings"] == remote["findings"],
        "probes": {k: round(v, 4) for k, v in p.items()}, "start_local_s": round(start_local, 2),
        "start_cluster_s": round(start_cluster, 2), "overhead_per_lane": per_lane,
    }
    print()
    print(f"{'':10} {'seconds':>8} {'lanes/min':>10} {'runs':>5}  findings")
    for name in ("local", "cluster"):
        r = result[name]
        found = ", ".join(r["findings"]) or "-"
        print(f"{name:10} {r['seconds']:8.1f} {r['lanes_per_minute']:10.2f} {r['runs']:5}  {found}")
    print(f"same findings: {result['same_findings']}")
    print(f"worker first start: local {start_local:.2f} s, cluster {start_cluster:.2f} s "
          f"(placement group + actor + worker); difference {per_lane['first_start_s']:.2f} s")
    if per_lane["fresh_start_s"] is not None:
        print(f"fresh worker per lane: local {p['fresh_local']:.2f} s, cluster {p['fresh_cluster']:.2f} s; "
              f"overhead {per_lane['fresh_start_s']:.2f} s per lane")
    print(f"one run: local {p['run_local']:.3f} s, cluster {p['run_cluster']:.3f} s; transfer "
          f"{per_lane['transfer_per_run_s']:.4f} s per run, {per_lane['transfer_per_lane_s']:.3f} s per lane of "
          f"{args.lane}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["same_findings"] else 1


if __name__ == "__main__":
    sys.exit(main())
