"""Exploring real DeepSpeed: examples per second, and time and examples to each seed bug.

    python benchmarks/bench_deepspeed_explore.py [--examples 200] [--rate-examples 100] [--jobs 1 2]
        [--releases 0.18.4 0.18.6 0.19.2] [--json OUT]

Two measurements, both on CPU (gloo, world size 1, ``OMP_NUM_THREADS=1``):

* **throughput** -- ``--rate-examples`` scenarios drawn (derandomized) from
  ``targets.strategies.scenarios()`` run one after another through the installed
  DeepSpeed's persistent worker, findings or not; reported as examples per second
  (the worker's start-up is excluded, and so is the world-size-2 rank pool's that `prestart` begins in the
  background: timing starts once it is up, so no example's time holds the wait for the pool).  With ``--jobs``
  N the explorer's own generated sequence (its first ``--rate-examples``, duplicates dropped) runs as
  `zerostate explore --jobs N` runs it (the explorer's lanes of
  ``LANE`` examples, each in a worker started fresh for it, N workers at once; start-ups excluded,
  the fresh starts between lanes included).
  The default strategy draws the training-setup dimensions too (bf16, offload, parameter groups, the HF
  Llama family ...); the fp16 draws (about one in four) run on DeepSpeed's CPU accelerator too
  (`fp16.allow_fp16_on_cpu`), so every drawn example is a trained one.
* **time to each seed bug** -- ``zerostate.explorer.exploration.explore`` from scratch (no
  Hypothesis database; the ci profile's derandomized sequence) with ``--examples`` per
  search, per release, stopping once the seed's finding is final: seconds from the start of
  exploring (target start-up reported separately) until it is first handed over (unshrunk, the
  first generated example with its key: ``seconds``) and until its shrunk, confirmed finding is
  (``seconds_shrunk``; ``seconds_confirmed``: once replayed in a fresh worker),
  the position of the first generated example that has it, distinct target
  runs until then, and the size of the shrunk scenario.  The seed predicate judges a finding's
  scenario too (seed 000 part 1: ZeRO-3, a reentrant block, a PyTorch-style backward): the first
  example with a new key need not have the seed's shape, so the benchmark also gives when an example
  with a seed-shaped finding first ran (``first_seed_shaped_run_s``) and when its key was first
  handed over (``key_handed_over_s``, with whichever example first had that key).

  The seed bugs and how a finding is recognised as one are ``SEED_BUGS`` in
  ``known/issues.py``: 0.18.4 -- seed 000 part 1 (a ZeRO-3 scenario with a reentrant
  block and a PyTorch-style backward whose shrunk finding is the ``unknown parameter type``
  exception or the epilogue / bucket spec violations); 0.18.6 -- seed 000 part 2
  (``count-once-per-phase``); 0.19.2 -- seed 002 (``saved-tensor-intact`` on a ZeRO-3 scenario
  with a non-reentrant block holding a frozen parameter).

Writes JSON (``--json``, default ``zerostate-bench/deepspeed_explore.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RELEASES = ("0.18.4", "0.18.6", "0.19.2")


def _built(result: dict) -> str:
    """The DeepSpeed ops JIT-built while the workers started (in their start-up, not in the examples)."""
    return f", including the JIT build of {', '.join(result['jit_builds'])}" if result.get("jit_builds") else ""


def throughput_jobs(n: int, jobs: int) -> dict:
    """``n`` scenarios of the explorer's own generated sequence, in its lanes, on ``jobs`` workers."""
    import threading

    from zerostate.targets.interface import get_target
    from zerostate.explorer.generate import LANE, generated
    from zerostate.explorer.workers import run_lanes
    from zerostate.explorer.strategies import scenarios
    t0 = time.perf_counter()
    workers = [get_target("deepspeed") for _ in range(jobs)]
    for w in workers:
        w.prestart(2)  # as `zerostate explore` does (cli.cmd_explore._prestarted): the strategy draws world size 2
    for w in workers:
        w.wait_prestarted()  # the rank pool's start-up is start-up, not the first world-size-2 example's
    startup = time.perf_counter() - t0
    unique = list(dict.fromkeys(generated(scenarios(), n, None)))
    lanes = iter([unique[i:i + LANE] for i in range(0, len(unique), LANE)])
    t1 = time.perf_counter()
    ran = sum(1 for step in run_lanes(workers, lanes, threading.Event(), [False] * jobs) if step.scenario is not None)
    total = time.perf_counter() - t1
    version = workers[0].version
    started = [s for w in workers for s in w.startup()]
    for w in workers:
        w.close()
    return {"deepspeed": version, "jobs": jobs, "examples": ran, "seconds": round(total, 2),
            "examples_per_second": round(ran / total, 2), "worker_startup_s": round(startup, 2),
            "jit_builds": sorted({op for s in started for op in s["jit_builds"]})}


def throughput(n: int) -> dict:
    from hypothesis import HealthCheck, Phase, given, settings

    from zerostate.targets.interface import get_target
    from zerostate.explorer.strategies import scenarios
    t0 = time.perf_counter()
    target = get_target("deepspeed")
    target.prestart(2)  # as `zerostate explore` does
    target.wait_prestarted()
    startup = time.perf_counter() - t0
    times: list[float] = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(scenarios())
    def run(sc):
        s = time.perf_counter()
        target.run(sc)
        times.append(time.perf_counter() - s)

    t1 = time.perf_counter()
    run()
    total = time.perf_counter() - t1
    started = target.startup()
    target.close()
    times.sort()
    return {"deepspeed": target.version, "examples": len(times), "seconds": round(total, 2),
            "examples_per_second": round(len(times) / total, 2), "median_example_s": round(times[len(times) // 2], 4),
            "max_example_s": round(times[-1], 3), "worker_startup_s": round(startup, 2),
            "jit_builds": sorted({op for s in started for op in s["jit_builds"]})}


def time_to_seed(version: str, examples: int) -> dict:
    from zerostate.targets.interface import get_target
    from zerostate.known.issues import SEED_BUGS
    from zerostate.explorer.exploration import explore
    seed, is_seed = SEED_BUGS[version]
    t0 = time.perf_counter()
    target = get_target("deepspeed", deepspeed=version)
    target.prestart(2)  # as `zerostate explore` does
    target.wait_prestarted()
    startup = time.perf_counter() - t0
    first_run: dict[str, float] = {}  # the first run of an example with a seed-shaped finding
    plain_run = target.run

    def run(sc):
        out = plain_run(sc)
        hit = next((f for f in out.findings if is_seed(f)), None)
        if hit is not None and not first_run:
            first_run.update(seconds=time.perf_counter() - t0 - startup, key=hit.key)
        return out

    target.run = run

    shrunk_at: dict[str, float] = {}  # key -> seconds until its shrunk finding (before its confirmation)

    def say(what: str):
        def show(f):
            s = time.perf_counter() - t0 - startup
            if what == "updated" and f.confirmation is None:
                shrunk_at.setdefault(f.key, s)
            print(f"  {s:6.1f}s {what} {f.key}", file=sys.stderr, flush=True)
        return show

    res = explore(target, examples=examples, seed=None, stop=lambda found: any(map(is_seed, found)),
                  on_finding=say("found"), on_update=say("updated"))
    target.close()
    hit = next((f for f in res.findings if is_seed(f)), None)
    key = hit.key if hit else None
    return {"release": version, "seed": seed, "key": key, "found": hit is not None,
            "seconds": round(res.seconds_to.get(key, float("nan")), 1) if key else None,
            "seconds_shrunk": round(shrunk_at[key], 1) if key in shrunk_at else None,
            "seconds_confirmed": round(res.seconds_final.get(key, float("nan")), 1) if key else None,
            "first_seed_shaped_run_s": round(first_run["seconds"], 1) if first_run else None,
            "first_seed_shaped_key": first_run.get("key"),
            "key_handed_over_s": round(res.seconds_to.get(first_run.get("key"), float("nan")), 1)
                                    if first_run else None,
            "target_startup_s": round(startup, 1), "explored_seconds": round(res.seconds, 1),
            "generated_position": res.generated_at.get(key), "distinct_runs_until_found": res.first_seen.get(key),
            "blocks": len(hit.scenario.blocks) if hit else None, "steps": len(hit.scenario.steps) if hit else None,
            "scenario": hit.scenario.to_dict() if hit else None,
            "other_findings_before": sorted(k for k in res.seconds_to if k != key)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--rate-examples", type=int, default=100)
    ap.add_argument("--releases", nargs="*", default=list(RELEASES))
    ap.add_argument("--jobs", nargs="*", type=int, default=[1, 2],
                    help="also the explorer's own generated sequence (``--rate-examples`` of it, in its lanes) "
                         "with these many workers")
    ap.add_argument("--json", default="zerostate-bench/deepspeed_explore.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out: dict = {"seeds": []}
    if args.rate_examples:
        out["throughput"] = tp = throughput(args.rate_examples)
        print(f"throughput on DeepSpeed {tp['deepspeed']}: {tp['examples']} examples in {tp['seconds']} s = "
              f"{tp['examples_per_second']} examples/s (median {tp['median_example_s']} s; worker start-up "
              f"{tp['worker_startup_s']} s{_built(tp)})", flush=True)
        out["throughput_jobs"] = []
        for j in args.jobs:
            tj = throughput_jobs(args.rate_examples, j)
            out["throughput_jobs"].append(tj)
            print(f"throughput with --jobs {j}: {tj['examples']} examples in {tj['seconds']} s = "
                  f"{tj['examples_per_second']} examples/s (start-up {tj['worker_startup_s']} s{_built(tj)})",
                  flush=True)
    def fmt(x: object) -> str:
        return '-' if x is None else str(x)

    print(f"{'release':8} {'seed':16} {'found':6} {'seconds':>8} {'shrunk':>8} {'position':>9} {'runs':>6} "
          f"{'size':>10}")
    for v in args.releases:
        r = time_to_seed(v, args.examples)
        out["seeds"].append(r)
        print(f"{v:8} {r['seed']:16} {r['found']!s:6} {fmt(r['seconds']):>8} {fmt(r['seconds_shrunk']):>8} "
              f"{r['generated_position']!s:>9} "
              f"{r['distinct_runs_until_found']!s:>6} {str(r['blocks'])+'b/'+str(r['steps'])+'s':>10}", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["found"] for r in out["seeds"]) else 1


if __name__ == "__main__":
    sys.exit(main())
