"""The one timing loop of the seed-000 benchmarks (bench_hook_overhead.py, bench_watch.py): one process.

    python benchmarks/seed000_worker.py '{"stages": [2, 3], "steps": 30, "warmup": 5, "with": null, "paired": 0}'

Seed 000's model: 73 ``Linear(64, 64)`` + ``LayerNorm(64)`` (148 parameter tensors), batch 8, fp32,
``engine.backward``, one process, ``torch.set_num_threads(1)`` (run it with ``OMP_NUM_THREADS=1``), gloo
on CPU.  ``with`` names what is added to the engine: ``runtime`` (`zerostate.runtime.install`), ``watch``
(`zerostate.watch`: every spec checked online) or nothing.  Per ZeRO stage:

* ``warmup`` steps, then ``steps`` timed steps with the add-on on from the start: ``median`` / ``mean`` /
  ``min`` / ``times`` (wall seconds per step) and ``cpu_median`` (process CPU seconds per step, which
  other processes on a shared machine disturb less than the wall clock);
* with ``paired`` > 0 and an add-on: ``paired``, a same-engine A/B -- ``paired`` pairs of blocks of
  ``block`` steps (default 5), one block without the add-on then one with it (install / uninstall,
  watch / close; the first step after each switch not timed), so drift hits both alike.  Per pair the
  ratio of the two blocks' median step times; ``ratio_median``: the median of those ratios (wall),
  ``cpu_ratio_median`` the same on CPU time, and the overall medians per mode.

Prints one line: ``@@RESULT@@`` + JSON.
"""

import json
import logging
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
_s = socket.socket()
_s.bind(("127.0.0.1", 0))
_port = _s.getsockname()[1]
_s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
try:  # one rank: the shared-memory comm op has nothing to reduce; skip its JIT build (30-90 s)
    import deepspeed.comm.torch as _ds_comm_torch
    if hasattr(_ds_comm_torch, "build_shm_op"):
        _ds_comm_torch.build_shm_op = lambda: None
except ImportError:
    pass


def engine_for(stage: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(73)], torch.nn.LayerNorm(64))
    assert sum(1 for _ in model.parameters()) == 148
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


class AddOn:
    """What ``with`` puts on the engine, and takes off again."""

    def __init__(self, kind: str | None, engine):
        self.kind, self.engine, self.handle, self.info = kind, engine, None, {}

    def on(self) -> None:
        if self.kind == "runtime":
            from zerostate.runtime import install
            inst = install(self.engine)
            self.info = {"release_policy": inst.release_policy, "closures_replaced": len(inst.swaps)}
        elif self.kind == "watch":
            import zerostate
            self.handle = zerostate.watch(self.engine)

    def off(self) -> None:
        if self.kind == "runtime":
            from zerostate.runtime import uninstall
            uninstall(self.engine)
        elif self.kind == "watch" and self.handle is not None:
            self.info = {"violations": len(self.handle.violations), "events": self.handle.events}
            self.handle.close()
            self.handle = None


def timed(step, n: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of ``n`` calls of ``step``."""
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return wall, cpu


def measure(stage: int, a: dict) -> dict:
    engine = engine_for(stage)
    x = torch.randn(8, 64)

    def step():
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()

    add = AddOn(a.get("with"), engine)
    add.on()
    timed(step, a["warmup"])
    wall, cpu = timed(step, a["steps"])
    res = {"median": statistics.median(wall), "mean": statistics.fmean(wall), "min": min(wall), "times": wall,
           "cpu_median": statistics.median(cpu)}
    add.off()
    res["with"] = dict(add.info)
    if add.kind and a.get("paired"):
        block = a.get("block", 5)
        modes = {"off": ([], []), "on": ([], [])}
        ratios, cpu_ratios = [], []
        for _ in range(a["paired"]):
            meds = {}
            for mode in ("off", "on"):
                (add.on if mode == "on" else add.off)()
                step()  # the first step after a switch (a new watch's first events, re-wrapping) is not timed
                w, c = timed(step, block)
                modes[mode][0].extend(w)
                modes[mode][1].extend(c)
                meds[mode] = (statistics.median(w), statistics.median(c))
            add.off()
            ratios.append(meds["on"][0] / meds["off"][0])
            cpu_ratios.append(meds["on"][1] / meds["off"][1])
        res["paired"] = {m: {"median": statistics.median(w), "min": min(w), "cpu_median": statistics.median(c)}
                         for m, (w, c) in modes.items()}
        res["paired"].update(block=block, pairs=a["paired"], ratios=ratios, cpu_ratios=cpu_ratios,
                             ratio_median=statistics.median(ratios), cpu_ratio_median=statistics.median(cpu_ratios))
    engine.destroy()
    return res


def main() -> None:
    a = json.loads(sys.argv[1])
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"deepspeed": deepspeed.__version__, "file": deepspeed.__file__, "with": a.get("with"), "stages": {}}
    for stage in a["stages"]:
        out["stages"][str(stage)] = measure(stage, a)
    print("@@RESULT@@" + json.dumps(out))


if __name__ == "__main__":
    main()
