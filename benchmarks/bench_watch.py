"""Overhead of ``zerostate watch``: seconds per train step, watched vs plain, on the installed DeepSpeed.

    python benchmarks/bench_watch.py [--steps 20] [--warmup 3] [--rounds 2] [--hf-steps 8] [--json OUT]

1. Seed 000's model (as benchmarks/bench_hook_overhead.py: 73 ``Linear(64, 64)`` + ``LayerNorm``, 148
   parameter tensors, batch 8, fp32, ``engine.backward``, ``OMP_NUM_THREADS=1``), ZeRO-2 and ZeRO-3;
   watched with ``zerostate.watch(engine)`` (every spec checked online, memory measured).
2. The tiny HF job (`zerostate.targets.hf_job`: Llama hidden 64, 2 layers, PEFT LoRA r=4, non-reentrant
   gradient checkpointing, HF ``Trainer``, ZeRO-3 at DeepSpeed's defaults), plain vs under
   ``zerostate watch -- python -m zerostate.targets.hf_job``; seconds of each ``training_step``
   (forward + backward + step) as the job measures them, the first two dropped.

``--only paired``: seed 000's model on one engine, blocks of 5 steps alternately plain and watched
(``zerostate.watch`` / ``handle.close()``), the median of the per-pair ratios: robust to a shared
machine's drift, which the subprocess figures are not.

Each configuration runs in its own subprocess; ``--rounds`` rounds run every configuration once each,
so drift on a shared machine hits both alike; the figure is the median over rounds of each round's
median.  Target (issue 12): watched <= 1.3x plain on the HF job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

WORKER = r"""
import json, os, socket, statistics, sys, time
os.environ.setdefault("DS_ACCELERATOR", "cpu")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import logging
import torch, deepspeed
from zerostate.targets.deepspeed import compat
torch.set_num_threads(1)
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
compat.skip_shm_comm_op()
deepspeed.init_distributed(dist_backend="gloo")
a = json.loads(sys.argv[1])
out = {}
for stage in a["stages"]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(73)], torch.nn.LayerNorm(64))
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    handle = None
    if a.get("paired"):  # one engine, blocks of steps alternately plain and watched: drift hits both alike
        import zerostate
        x = torch.randn(8, 64)
        def block(n):
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                loss = engine(x).pow(2).mean(); engine.backward(loss); engine.step()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
        block(a["warmup"])
        ratios = []
        for _ in range(a["pairs"]):
            p = block(5)
            h = zerostate.watch(engine)
            w = block(5)
            h.close()
            ratios.append(w / p)
        out[stage] = {"median_ratio": statistics.median(ratios), "ratios": ratios}
        engine.destroy()
        continue
    if a["watch"]:
        import zerostate
        handle = zerostate.watch(engine)
    x = torch.randn(8, 64)
    times = []
    for i in range(a["warmup"] + a["steps"]):
        t0 = time.perf_counter()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if i >= a["warmup"]:
            times.append(time.perf_counter() - t0)
    out[stage] = {"median": statistics.median(times),
                  "violations": len(handle.violations) if handle else None}
    if handle:
        handle.close()
    engine.destroy()
print(json.dumps(out))
"""


def _seed000(watch: bool, a) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    arg = json.dumps({"watch": watch, "stages": [2, 3], "steps": a.steps, "warmup": a.warmup})
    p = subprocess.run([sys.executable, "-c", WORKER, arg], capture_output=True, text=True, env=env, timeout=900)
    if p.returncode:
        raise SystemExit(f"seed-000 worker failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _paired(a) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    arg = json.dumps({"watch": False, "paired": True, "pairs": a.pairs, "stages": [2, 3], "steps": 0,
                      "warmup": a.warmup})
    p = subprocess.run([sys.executable, "-c", WORKER, arg], capture_output=True, text=True, env=env, timeout=900)
    if p.returncode:
        raise SystemExit(f"paired worker failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _hf(watch: bool, a) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = [sys.executable, "-m", "zerostate.targets.hf_job", "--ckpt", "non_reentrant", "--steps", str(a.hf_steps)]
    with tempfile.TemporaryDirectory() as d:
        cmd = ([sys.executable, "-m", "zerostate.cli.main", "watch", "--out", d, "--", *job] if watch else job)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        res = json.loads(p.stdout.strip().splitlines()[-1])
        viol = None
        if watch:
            with open(os.path.join(d, "report.json")) as fh:
                viol = len(json.load(fh)["findings"])
    if "error" in res:
        raise SystemExit(f"HF job failed: {res['error']['type']}: {res['error']['message'][:500]}")
    secs = [r["seconds"] for r in res["per_step"]][2:]
    return {"median": statistics.median(secs), "violations": viol}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hf-steps", type=int, default=8)
    ap.add_argument("--only", choices=["seed000", "hf", "paired"], default=None, help="one of the jobs")
    ap.add_argument("--pairs", type=int, default=10, help="paired: plain/watched blocks of 5 steps on one engine")
    ap.add_argument("--json", default="zerostate-bench/watch.json")
    a = ap.parse_args(argv)
    if a.only == "paired":
        res = _paired(a)
        for stage, r in res.items():
            print(f"seed000-zero{stage} paired on one engine: watched/plain median ratio {r['median_ratio']:.2f} "
                  f"over {len(r['ratios'])} pairs")
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"paired": res, "args": vars(a)}, fh, indent=2)
        return 0
    rounds: dict[str, list[float]] = {}
    viol: dict[str, object] = {}
    for _ in range(a.rounds):
        for watch in (False, True):
            tag = "watch" if watch else "plain"
            if a.only in (None, "seed000"):
                for stage, r in _seed000(watch, a).items():
                    rounds.setdefault(f"seed000-zero{stage}-{tag}", []).append(r["median"])
                    viol[f"seed000-zero{stage}-{tag}"] = r["violations"]
            if a.only in (None, "hf"):
                r = _hf(watch, a)
                rounds.setdefault(f"hf-lora-zero3-{tag}", []).append(r["median"])
                viol[f"hf-lora-zero3-{tag}"] = r["violations"]
    med = {k: statistics.median(v) for k, v in rounds.items()}
    rows = []
    print(f"{'job':<22} {'plain s/step':>13} {'watch s/step':>13} {'ratio':>7}  violations")
    for job in ("seed000-zero2", "seed000-zero3", "hf-lora-zero3"):
        if f"{job}-plain" not in med:
            continue
        p, w = med[f"{job}-plain"], med[f"{job}-watch"]
        rows.append({"job": job, "plain": p, "watch": w, "ratio": w / p, "violations": viol[f"{job}-watch"]})
        print(f"{job:<22} {p:13.4f} {w:13.4f} {w / p:7.2f}  {viol[f'{job}-watch']}")
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump({"rows": rows, "rounds": rounds, "args": vars(a)}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
