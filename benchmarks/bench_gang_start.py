"""A world-size-N gang's start: forked from the fork server against started as new processes.

    python benchmarks/bench_gang_start.py [--world-size 4] [--repeat 3] [--json OUT]

A gang is the rank pool of a world-size-N example: N rank processes that rendezvous on one process group, import
DeepSpeed and answer hello (`harness.rank_pool.RankPool`, as `DeepSpeedRanksTarget` starts it).  For each way
of starting, the target runs one example first (the fork server's own start-up, paid once per release and world
size, is left out: it is the same cost a started pool pays every time), then ``--repeat`` new gangs are started
and timed from the request to every rank's hello; each is closed before the next.  Prints the median and the
ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path


def _gang_starts(world_size: int, repeat: int) -> list[float]:
    from zerostate.model.scenario import Scenario
    from zerostate.targets.deepspeed.ranks import DeepSpeedRanksTarget

    t = DeepSpeedRanksTarget(world_size=world_size)
    try:
        t.run(Scenario())  # the first gang (and the fork server's start, when forking)
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            pool = t._new_worker()
            try:
                hello = t._hello(pool)
                out.append(time.perf_counter() - t0)
                assert hello.get("ok"), hello
            finally:
                pool.close(kill=True)
        return out
    finally:
        t.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default="zerostate-bench/gang_start.json")
    args = p.parse_args(argv)
    from zerostate.harness import forked

    times = {}
    for name in ("started", "forked"):
        with forked.disabled() if name == "started" else contextlib.nullcontext():
            times[name] = _gang_starts(args.world_size, args.repeat)
        print(f"{name}: {', '.join(f'{s:.2f}' for s in times[name])} s", flush=True)
    med = {n: statistics.median(v) for n, v in times.items()}
    print(f"\n| world size {args.world_size} gang start | median (s) | starts |\n|---|---:|---:|")
    for n in ("started", "forked"):
        print(f"| {n} | {med[n]:.2f} | {len(times[n])} |")
    ratio = med["started"] / max(med["forked"], 1e-9)
    print(f"\nforked {ratio:.1f}x faster")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"world_size": args.world_size, "seconds": times,
                                           "median": {n: round(v, 3) for n, v in med.items()},
                                           "ratio": round(ratio, 1)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
