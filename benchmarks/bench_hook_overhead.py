"""Hook-overhead benchmark: seconds per train step, stock 0.19.8 vs runtime-installed 0.19.8 vs stock 0.18.6.

    python benchmarks/bench_hook_overhead.py [--steps 30] [--warmup 5] [--rounds 3] [--json OUT]
        [--config NAME=VERSION[:runtime] ...]

The model is seed 000's: 73 ``Linear(64, 64)`` plus a ``LayerNorm`` (148 parameter tensors),
batch 8, one process, ``OMP_NUM_THREADS=1``, fp32, ``engine.backward``.  Each configuration
runs in its own subprocess with ``PYTHONPATH`` at a ``pip install --no-deps --target``
copy of its release (``$ZEROSTATE_BENCH_CACHE``, default ``~/.cache/zerostate/bench``;
the installed release is used when it matches) and its own ``TORCH_EXTENSIONS_DIR``.
Configurations are measured side by side: ``--rounds`` rounds, each running every
configuration once, so drift on a shared machine hits all of them alike; the reported
figure is the median over rounds of each round's median step time.

The timing loop is benchmarks/seed000_worker.py (shared with bench_watch.py); ``--paired`` runs its
same-engine A/B for runtime configurations (blocks of ``steps // 2`` steps, median of the per-pair ratios).

Prints a table of seconds per step and ratios against stock 0.19.8, for ZeRO-2 and ZeRO-3,
and writes JSON (``--json``, default ``zerostate-bench/hook_overhead.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CONFIGS = ["stock-0.19.8=0.19.8", "runtime-0.19.8=0.19.8:runtime", "stock-0.18.6=0.18.6"]
STAGES = (2, 3)

WORKER = Path(__file__).with_name("seed000_worker.py")
"""The timing loop (shared with bench_watch.py)."""


def cache_dir() -> Path:
    return Path(os.environ.get("ZEROSTATE_BENCH_CACHE") or Path.home() / ".cache" / "zerostate" / "bench")


def installed_version(python: str) -> str | None:
    p = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                       text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else None


def release_site(version: str, python: str) -> Path | None:
    """None: use the environment's own DeepSpeed (it is this release)."""
    if installed_version(python) == version:
        return None
    site = cache_dir() / version
    if not (site / "deepspeed" / "__init__.py").exists():
        site.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                        f"deepspeed=={version}"], check=True, env=dict(os.environ, DS_BUILD_OPS="0"))
    return site


def run_config(python: str, version: str, runtime: bool, site: Path | None, a: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    env["TORCH_EXTENSIONS_DIR"] = str(cache_dir() / "torch_extensions" / version)
    if site is not None:
        env["PYTHONPATH"] = str(site) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    arg = json.dumps({"with": "runtime" if runtime else None, "stages": list(a.stages), "steps": a.steps,
                      "warmup": a.warmup, "paired": a.paired if runtime else 0, "block": a.steps // 2})
    p = subprocess.run([python, str(WORKER), arg], capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            res = json.loads(line[len("@@RESULT@@"):])
            if res["deepspeed"] != version:
                raise RuntimeError(f"expected DeepSpeed {version}, the worker imported {res['deepspeed']}")
            return res
    raise RuntimeError(f"benchmark worker for {version} failed:\n{p.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paired", type=int, default=4,
                    help="runtime configs also time stock vs installed on the same engine, in this many "
                         "alternating block pairs (0: off)")
    ap.add_argument("--stages", type=int, nargs="+", default=list(STAGES))
    ap.add_argument("--config", nargs="+", default=DEFAULT_CONFIGS,
                    help="NAME=VERSION or NAME=VERSION:runtime; the first is the baseline of the ratios")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", default="zerostate-bench/hook_overhead.json")
    a = ap.parse_args(argv)
    configs = []
    for c in a.config:
        name, spec = c.split("=", 1)
        version, _, flag = spec.partition(":")
        configs.append((name, version, flag == "runtime"))
    sites = {v: release_site(v, a.python) for _, v, _ in configs}
    rounds: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    t0 = time.perf_counter()
    for r in range(a.rounds):
        for name, version, runtime in configs:
            res = run_config(a.python, version, runtime, sites[version], a)
            rounds[name].append(res)
            print(f"round {r + 1}/{a.rounds} {name:16s} " + "  ".join(
                f"z{s}={res['stages'][str(s)]['median']:.4f}s" for s in a.stages), flush=True)
    summary: dict = {"model": "73 x Linear(64,64) + LayerNorm(64), 148 parameter tensors, batch 8, fp32, "
                              "engine.backward, 1 process, OMP_NUM_THREADS=1, CPU (gloo)",
                     "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds, "baseline": configs[0][0],
                     "seconds": time.perf_counter() - t0, "configs": {}}
    for name, version, runtime in configs:
        summary["configs"][name] = {
            "deepspeed": version, "runtime": runtime,
            "installed": rounds[name][0]["stages"][str(a.stages[0])]["with"] or None,
            "seconds_per_step": {f"zero{s}": statistics.median(x["stages"][str(s)]["median"] for x in rounds[name])
                                 for s in a.stages},
            "per_round": {f"zero{s}": [x["stages"][str(s)]["median"] for x in rounds[name]] for s in a.stages},
            "min_seconds_per_step": {f"zero{s}": min(x["stages"][str(s)]["min"] for x in rounds[name])
                                     for s in a.stages}}
        if runtime and a.paired:
            summary["configs"][name]["paired_same_engine"] = {
                f"zero{s}": {"runtime_over_stock_median": statistics.median(
                    x["stages"][str(s)]["paired"]["ratio_median"] for x in rounds[name]),
                    "per_round": [x["stages"][str(s)]["paired"] for x in rounds[name]]} for s in a.stages}
    base = summary["configs"][configs[0][0]]["seconds_per_step"]
    for name in summary["configs"]:
        sps = summary["configs"][name]["seconds_per_step"]
        summary["configs"][name]["ratio_to_baseline"] = {k: sps[k] / base[k] for k in sps}
    print()
    header = f"{'configuration':18s}" + "".join(f"{'ZeRO-' + str(s) + ' s/step':>16s}{'ratio':>8s}" for s in a.stages)
    print(header)
    print("-" * len(header))
    for name, c in summary["configs"].items():
        print(f"{name:18s}" + "".join(f"{c['seconds_per_step'][f'zero{s}']:16.4f}"
                                      f"{c['ratio_to_baseline'][f'zero{s}']:8.2f}"
                                      for s in a.stages))
    print(f"(ratios against {configs[0][0]}; median over {a.rounds} rounds of the median of {a.steps} steps)")
    base_min = summary["configs"][configs[0][0]]["min_seconds_per_step"]
    print("fastest step:        " + "  ".join(
        f"{name}: " + ", ".join(f"z{s} {c['min_seconds_per_step'][f'zero{s}']:.4f}s "
                                f"({c['min_seconds_per_step'][f'zero{s}'] / base_min[f'zero{s}']:.2f})"
                                for s in a.stages) for name, c in summary["configs"].items()))
    for name, c in summary["configs"].items():
        if "paired_same_engine" in c:
            print(f"paired, same engine ({name}): runtime / stock = " + ", ".join(
                f"ZeRO-{s} {c['paired_same_engine'][f'zero{s}']['runtime_over_stock_median']:.3f}" for s in a.stages))
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
