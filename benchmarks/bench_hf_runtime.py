"""The Hugging Face job, stock DeepSpeed vs the zerostate runtime: s/step, frozen gathers, gathered frozen peak.

    python benchmarks/bench_hf_runtime.py [--steps 12] [--rounds 2] [--ckpt non_reentrant]
        [--configs default reuse0 persist0 persist0-reuse0] [--release VERSION] [--device cpu|cuda]
        [--dtype fp32|bf16] [--json OUT]

The job is `clients/hf_job.py` (tiny random-init Llama, hidden 64, 2 layers, vocab 128, LoRA r=4 on
q_proj/v_proj, gradient checkpointing, HF ``Trainer``, ZeRO-3, batch 4 x 16 tokens), one process per
(configuration, stock|runtime, round), ``OMP_NUM_THREADS=1``.  Configurations (``zero_optimization``
keys on top of DeepSpeed's defaults):

* ``default``         -- nothing set (persistence threshold 1e5: every weight of this tiny model is
                          persistent, ``stage3_max_reuse_distance`` 1e9);
* ``reuse0``          -- ``stage3_max_reuse_distance: 0``;
* ``persist0``        -- ``stage3_param_persistence_threshold: 0`` (every weight partitioned);
* ``persist0-reuse0`` -- both.

Per configuration and mode it reports, from the job's own counters (``--measure``: the engine's
parameter coordinator wrapped, DeepSpeed unchanged):

* ``s/step``: median over rounds of the median step time after ``--warmup`` steps (wall, shared
  machine: compare stock and runtime of the same row, measured in alternation); ``cpu s/step``: the
  same with the job process's CPU time (``time.process_time``), less disturbed by other load;
* ``gathers/bwd``: all-gathers of frozen parameters while a backward runs, first step (trace being
  recorded) and steady state (median of the later steps);
* ``peak frozen``: the most frozen elements gathered at once during a backward (sampled at every
  module fetch / release), first step and steady state (max of the later steps);
* the losses of stock and runtime are compared (``same_losses``).

Writes JSON (default ``zerostate-bench/hf_runtime.json``).  Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {
    "default": {},
    "reuse0": {"stage3_max_reuse_distance": 0},
    "persist0": {"stage3_param_persistence_threshold": 0},
    "persist0-reuse0": {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
}
_ENV_DROP = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def run_one(config: str, runtime: bool, a: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    if a.release:
        from zerostate.harness import envs

        env["PYTHONPATH"] = os.pathsep.join([str(envs.ensure_release(a.release))] + [
            p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["TORCH_EXTENSIONS_DIR"] = str(envs.extensions_dir_for(f"deepspeed-{a.release}"))
    with tempfile.TemporaryDirectory(prefix="zerostate-bench-hf-") as tmp:
        out = Path(tmp) / "job.json"
        cmd = [sys.executable, "-m", "zerostate.clients.hf_job", "--ckpt", a.ckpt, "--steps", str(a.steps),
               "--measure", "--device", a.device, "--dtype", a.dtype, "--json", str(out)]
        cmd += [f"--zero={k}={json.dumps(v)}" for k, v in CONFIGS[config].items()]
        if runtime:
            cmd.append("--runtime")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode or not out.exists():
            return {"error": {"type": "JobFailed", "message": proc.stderr[-2000:]}}
        return json.loads(out.read_text())


def summarize(records: list[dict], warmup: int) -> dict:
    rec = records[0]
    if "error" in rec:
        return {"error": f"{rec['error']['type']}: {rec['error']['message'].splitlines()[0][:200]}"}
    steps = rec["per_step"]
    later = steps[1:] or steps
    times = [statistics.median([s["seconds"] for s in r["per_step"][warmup:] or r["per_step"]]) for r in records
             if "error" not in r]
    cpu = [statistics.median([s["cpu_seconds"] for s in r["per_step"][warmup:] or r["per_step"]]) for r in records
           if "error" not in r]
    return {
        "deepspeed": rec["deepspeed"],
        "s_per_step": statistics.median(times),
        "s_per_step_rounds": times,
        "cpu_s_per_step": statistics.median(cpu),
        "cpu_s_per_step_rounds": cpu,
        "frozen_gathers_first_step": steps[0]["frozen_gathers_in_backward"],
        "frozen_gathers_steady": statistics.median(s["frozen_gathers_in_backward"] for s in later),
        "peak_frozen_first_step": steps[0]["peak_frozen_elements_in_backward"],
        "peak_frozen_steady": max(s["peak_frozen_elements_in_backward"] for s in later),
        "losses": rec["losses"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the time median")
    ap.add_argument("--rounds", type=int, default=2, help="runs per (configuration, mode), alternating")
    ap.add_argument("--ckpt", choices=["reentrant", "non_reentrant"], default="non_reentrant")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--release", default=None, help="a DeepSpeed release installed with envs.py (default: the "
                                                     "installed one)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--json", default="zerostate-bench/hf_runtime.json")
    a = ap.parse_args(argv)
    if a.steps < a.warmup + 2 or a.rounds < 1:
        ap.error("need --steps >= --warmup + 2 and --rounds >= 1")
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(a.rounds):
        for config in a.configs:
            for mode in ("stock", "runtime"):
                runs.setdefault((config, mode), []).append(run_one(config, mode == "runtime", a))
    rows = {f"{c}/{m}": summarize(r, a.warmup) for (c, m), r in runs.items()}
    for config in a.configs:
        s, r = rows[f"{config}/stock"], rows[f"{config}/runtime"]
        r["same_losses_as_stock"] = "losses" in s and "losses" in r and s["losses"] == r["losses"]
    head = (f"{'config':16s} {'mode':8s} {'s/step':>8s} {'cpu s/step':>10s} {'gathers/bwd 1st':>15s} {'steady':>7s} "
            f"{'peak frozen 1st':>15s} {'steady':>7s}")
    print(f"HF job ({a.ckpt}, {a.steps} steps, {a.rounds} rounds, {a.device} {a.dtype})\n{head}")
    for key, row in rows.items():
        config, mode = key.split("/")
        if "error" in row:
            print(f"{config:16s} {mode:8s} {row['error']}")
            continue
        print(f"{config:16s} {mode:8s} {row['s_per_step']:8.4f} {row['cpu_s_per_step']:10.4f} "
              f"{row['frozen_gathers_first_step']:15d} "
              f"{row['frozen_gathers_steady']:7g} {row['peak_frozen_first_step']:15d} {row['peak_frozen_steady']:7d}"
              + ("" if mode == "stock" else f"  same losses: {row['same_losses_as_stock']}"))
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
