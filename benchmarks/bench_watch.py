"""Overhead of ``zerostate watch``: seconds per train step, watched vs plain, on the installed DeepSpeed.

    python benchmarks/bench_watch.py [--steps 20] [--warmup 3] [--rounds 2] [--hf-steps 8] [--pairs 10]
        [--block 5] [--only seed000|hf|paired|hf-paired|trl-paired] [--json OUT]

1. Seed 000's model (as benchmarks/bench_hook_overhead.py: 73 ``Linear(64, 64)`` + ``LayerNorm``, 148
   parameter tensors, batch 8, fp32, ``engine.backward``, ``OMP_NUM_THREADS=1``), ZeRO-2 and ZeRO-3;
   watched with ``zerostate.watch(engine)`` (every spec checked online, memory measured).
2. The tiny HF job (`zerostate.clients.hf_job`: Llama hidden 64, 2 layers, PEFT LoRA r=4, non-reentrant
   gradient checkpointing, HF ``Trainer``, ZeRO-3 at DeepSpeed's defaults), plain vs under
   ``zerostate watch -- python -m zerostate.clients.hf_job``; seconds of each ``training_step``
   (forward + backward + step) as the job measures them, the first two dropped.

3. TRL's SFT job (`zerostate.clients.trl_job`: the same tiny Llama + LoRA, ``SFTTrainer``, gradient checkpointing
   as TRL leaves it -- non-reentrant, whatever TRL logs (docs/watch.md) -- ZeRO-3 at DeepSpeed's defaults), paired only
   (``--only trl-paired``): each step timed from a ``TrainerCallback`` (``on_step_begin`` to ``on_step_end``).

Paired (the figures to trust on a shared machine; run by default after the above, or alone with
``--only paired`` / ``--only hf-paired`` / ``--only trl-paired``):
one process, one engine, ``--pairs`` pairs of ``--block`` steps,
one block plain then one watched (``zerostate.watch`` / ``handle.close()``; the HF job toggles it from a
``TrainerCallback``), the first step of each block untimed; per pair the ratio of the blocks' median step
times; the figure is the median of those ratios, on the wall clock and on process CPU time.  Drift and
other processes hit both blocks of a pair alike.  The seed-000 timing loop is benchmarks/seed000_worker.py
(shared with bench_hook_overhead.py).

Each unpaired configuration runs in its own subprocess; ``--rounds`` rounds run every configuration once
each; the figure is the median over rounds of each round's median.  Targets: watched <= 1.3x plain; the
TRL SFT job <= 1.2x on the wall clock, paired.
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

WORKER = Path(__file__).with_name("seed000_worker.py")
"""The timing loop (shared with bench_hook_overhead.py)."""


def _worker(arg: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, str(WORKER), json.dumps(arg)], capture_output=True, text=True, env=env,
                       timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@"):])["stages"]
    raise SystemExit(f"seed-000 worker failed:\n{p.stderr[-3000:]}")


def _seed000(watch: bool, a) -> dict:
    res = _worker({"with": "watch" if watch else None, "stages": [2, 3], "steps": a.steps, "warmup": a.warmup})
    return {int(st): {"median": r["median"], "cpu_median": r["cpu_median"],
                      "violations": r["with"].get("violations")} for st, r in res.items()}


def _paired(a) -> dict:
    res = _worker({"with": "watch", "stages": [2, 3], "steps": a.steps, "warmup": a.warmup, "paired": a.pairs,
                   "block": a.block})
    return {int(st): dict(r["paired"], violations=r["with"].get("violations")) for st, r in res.items()}


HF_PAIRED = r"""
import json, statistics, sys
import deepspeed
from transformers import TrainerCallback
import zerostate
from zerostate.clients import hf_job
a = json.loads(sys.argv[1])
engines = []
original = deepspeed.initialize
def initialize(*x, **k):
    r = original(*x, **k)
    engines.append(r[0])
    return r
deepspeed.initialize = initialize
modes, counts = [], {"violations": 0}
class Toggle(TrainerCallback):  # blocks of a["block"] steps, alternately plain and watched, on one engine
    handle = None
    def on_step_begin(self, args, state, control, **kw):
        on = (state.global_step // a["block"]) % 2 == 1
        if on and self.handle is None:
            self.handle = zerostate.watch(engines[-1])
        elif not on and self.handle is not None:
            self._close()
        modes.append("on" if on else "off")
    def _close(self):
        counts["violations"] += len(self.handle.violations)
        self.handle.close()
        self.handle = None
    def on_train_end(self, args, state, control, **kw):
        if self.handle is not None:
            self._close()
res = hf_job.run(ckpt="non_reentrant", steps=a["steps"], callbacks=[Toggle()])
if "error" in res:
    raise SystemExit(f"HF job failed: {res['error']['type']}: {res['error']['message'][:500]}")
rows = res["per_step"]
ratios, cpu_ratios, by = [], [], {"on": [], "off": []}
b = a["block"]
for i in range(0, len(rows) - 2 * b + 1, 2 * b):  # a pair: b plain steps, then b watched (the first of each untimed)
    off, on = rows[i + 1:i + b], rows[i + b + 1:i + 2 * b]
    if i == 0:
        off = off[1:]  # the job's first steps build and warm up
    ratios.append(statistics.median(r["seconds"] for r in on) / statistics.median(r["seconds"] for r in off))
    cpu_ratios.append(statistics.median(r["cpu_seconds"] for r in on) /
                      statistics.median(r["cpu_seconds"] for r in off))
    by["off"] += [r["seconds"] for r in off]
    by["on"] += [r["seconds"] for r in on]
assert modes[:2 * b] == ["off"] * b + ["on"] * b, modes
print("@@RESULT@@" + json.dumps({"ratios": ratios, "cpu_ratios": cpu_ratios, "ratio_median": statistics.median(ratios),
                                 "cpu_ratio_median": statistics.median(cpu_ratios),
                                 "plain_median": statistics.median(by["off"]),
                                 "watch_median": statistics.median(by["on"]),
                                 "violations": counts["violations"], "losses": res["losses"]}))
"""


TRL_PAIRED = r"""
import json, statistics, sys, time
import trl  # as a TRL script: trl (transformers, accelerate, peft) before deepspeed
import deepspeed
from transformers import TrainerCallback
import zerostate
from zerostate.clients import trl_job
a = json.loads(sys.argv[1])
engines = []
original = deepspeed.initialize
def initialize(*x, **k):
    r = original(*x, **k)
    engines.append(r[0])
    return r
deepspeed.initialize = initialize
rows, counts = [], {"violations": 0, "backwards": 0}
class Toggle(TrainerCallback):  # blocks of a["block"] steps, alternately plain and watched, on one engine; timed
    handle = None
    def on_step_begin(self, args, state, control, **kw):
        on = (state.global_step // a["block"]) % 2 == 1
        if on and self.handle is None:
            self.handle = zerostate.watch(engines[-1])
        elif not on and self.handle is not None:
            self._close()
        self.t = (time.perf_counter(), time.process_time(), on)
    def on_step_end(self, args, state, control, **kw):
        t0, c0, on = self.t
        rows.append({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "on": on})
    def _close(self):
        counts["violations"] += len(self.handle.violations)
        counts["backwards"] += self.handle.backwards
        self.handle.close()
        self.handle = None
    def on_train_end(self, args, state, control, **kw):
        if self.handle is not None:
            self._close()
trl_job._setup_env("cpu")
res = trl_job.run("sft", steps=a["steps"], callbacks=[Toggle()])
if "error" in res:
    raise SystemExit(f"TRL job failed: {res['error']['type']}: {res['error']['message'][:500]}")
ratios, cpu_ratios, by = [], [], {"on": [], "off": []}
b = a["block"]
for i in range(0, len(rows) - 2 * b + 1, 2 * b):  # a pair: b plain steps, then b watched (the first of each untimed)
    off, on = rows[i + 1:i + b], rows[i + b + 1:i + 2 * b]
    assert not any(r["on"] for r in off) and all(r["on"] for r in on), rows
    if i == 0:
        off = off[1:]  # the job's first steps build and warm up
    ratios.append(statistics.median(r["seconds"] for r in on) / statistics.median(r["seconds"] for r in off))
    cpu_ratios.append(statistics.median(r["cpu_seconds"] for r in on) /
                      statistics.median(r["cpu_seconds"] for r in off))
    by["off"] += [r["seconds"] for r in off]
    by["on"] += [r["seconds"] for r in on]
print("@@RESULT@@" + json.dumps({"ratios": ratios, "cpu_ratios": cpu_ratios, "ratio_median": statistics.median(ratios),
                                 "cpu_ratio_median": statistics.median(cpu_ratios),
                                 "plain_median": statistics.median(by["off"]),
                                 "watch_median": statistics.median(by["on"]),
                                 "violations": counts["violations"], "watched_backwards": counts["backwards"],
                                 "use_reentrant": res["use_reentrant"]}))
"""


def _trl_paired(a) -> dict:
    """TRL's SFT job (`zerostate.clients.trl_job`, TRL's own checkpointing choice) once, its steps in blocks
    alternately plain and watched on the one engine, each step timed from a ``TrainerCallback``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    steps = 2 * a.block * a.pairs
    p = subprocess.run([sys.executable, "-c", TRL_PAIRED, json.dumps({"steps": steps, "block": a.block})],
                       capture_output=True, text=True, env=env, timeout=3600)
    for line in p.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@"):])
    raise SystemExit(f"TRL paired worker failed:\n{p.stderr[-3000:]}")


def _hf_paired(a) -> dict:
    """The HF job once, its steps in blocks alternately plain and watched (``zerostate.watch`` / ``close``
    from a ``TrainerCallback``) on the one engine the Trainer builds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    steps = 2 * a.block * a.pairs
    p = subprocess.run([sys.executable, "-c", HF_PAIRED, json.dumps({"steps": steps, "block": a.block})],
                       capture_output=True, text=True, env=env, timeout=3600)
    for line in p.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@"):])
    raise SystemExit(f"HF paired worker failed:\n{p.stderr[-3000:]}")


def _hf(watch: bool, a) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = [sys.executable, "-m", "zerostate.clients.hf_job", "--ckpt", "non_reentrant", "--steps", str(a.hf_steps)]
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


def _load() -> str:
    """The 1-minute load average (the machine is often shared: say it beside every figure)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:  # pragma: no cover
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hf-steps", type=int, default=8)
    ap.add_argument("--only", choices=["seed000", "hf", "paired", "hf-paired", "trl-paired"], default=None,
                    help="one of the measurements (default: seed000 and hf in subprocesses, then both paired)")
    ap.add_argument("--pairs", type=int, default=10, help="paired: plain/watched block pairs on one engine")
    ap.add_argument("--block", type=int, default=5, help="paired: steps per block")
    ap.add_argument("--json", default="zerostate-bench/watch.json")
    a = ap.parse_args(argv)
    paired: dict[str, dict] = {}
    load = [_load()]
    if a.only in (None, "paired"):
        for stage, r in _paired(a).items():
            paired[f"seed000-zero{stage}"] = r
    if a.only in (None, "hf-paired"):
        paired["hf-lora-zero3"] = _hf_paired(a)
    if a.only in (None, "trl-paired"):
        paired["trl-sft-lora-zero3"] = _trl_paired(a)
    for job, r in paired.items():
        print(f"{job:<16} paired on one engine: watched/plain median ratio {r['ratio_median']:.2f} wall, "
              f"{r['cpu_ratio_median']:.2f} CPU time, over {len(r['ratios'])} pairs of {a.block} steps "
              f"(wall ratios {', '.join(f'{x:.2f}' for x in r['ratios'])}; CPU time ratios "
              f"{', '.join(f'{x:.2f}' for x in r['cpu_ratios'])}); violations {r['violations']}")
    if paired:
        print(f"load average before / after: {load[0]} / {_load()}")
    if a.only in ("paired", "hf-paired", "trl-paired"):
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"paired": paired, "args": vars(a), "load": [load[0], _load()]}, fh, indent=2)
        return 0
    rounds: dict[str, list[float]] = {}
    viol: dict[str, object] = {}
    for _ in range(a.rounds):
        for watch in (False, True):
            tag = "watch" if watch else "plain"
            if a.only in (None, "seed000"):
                for stage, r in _seed000(watch, a).items():
                    rounds.setdefault(f"seed000-zero{stage}-{tag}", []).append(r["median"])
                    rounds.setdefault(f"seed000-zero{stage}-{tag}-cpu", []).append(r["cpu_median"])
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
        cpu = (med[f"{job}-watch-cpu"] / med[f"{job}-plain-cpu"]) if f"{job}-plain-cpu" in med else None
        rows.append({"job": job, "plain": p, "watch": w, "ratio": w / p, "cpu_ratio": cpu,
                     "violations": viol[f"{job}-watch"]})
        print(f"{job:<22} {p:13.4f} {w:13.4f} {w / p:7.2f}  {viol[f'{job}-watch']}"
              + (f"  (CPU time ratio {cpu:.2f})" if cpu else ""))
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump({"rows": rows, "rounds": rounds, "paired": paired, "args": vars(a)}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
