"""Self-check of the zerostate runtime against the DeepSpeed release that is importable here.

    python -m zerostate.runtime.selfcheck [--no-install] [--json OUT] [--only NAME ...]

Runs small CPU (gloo, world size 1) training cases on real DeepSpeed, with the runtime
installed (default) or stock (``--no-install``), and reports per case:

* ``error``      -- the exception, if the case crashed (seed 000 / seed 002 crashes show here);
* ``max_diff``   -- largest |param - reference| after the steps, against plain PyTorch SGD;
* ``counts``     -- calls to ``count_used_parameters_in_backward`` per backward (max over backwards);
* ``phase_violations`` -- backwards in which it ran more than once in one graph task
  (the count-once-per-phase spec);
* for ZeRO-3 recompute cases: the status of each frozen parameter right after its last
  consumer's backward (``after_last_use``) and whether any stayed gathered after the backward.

Each release is meant to run in its own process (``PYTHONPATH=<--target install>``); the
runtime itself never imports zerostate.targets.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
import traceback
from typing import Any

CASES: dict[str, dict[str, Any]] = {}


def _case(name: str, **kw: Any) -> None:
    CASES[name] = kw


for _stage in (1, 2, 3):
    for _ck in ("none", "reentrant", "non_reentrant"):
        for _bw in ("engine", "torch", "nonscalar"):
            _case(f"z{_stage}-{_ck}-{_bw}", stage=_stage, ckpt=_ck, backward=_bw, frozen=False, gas=1)
    _case(f"z{_stage}-reentrant-torch-gas2", stage=_stage, ckpt="reentrant", backward="torch", frozen=False, gas=2)
# seed 002: frozen norm + trainable lin per block, non-reentrant checkpoint, ZeRO-3, persistence 0
_case("z3-seed002-engine", stage=3, ckpt="non_reentrant", backward="engine", frozen=True, gas=1)
_case("z3-seed002-torch", stage=3, ckpt="non_reentrant", backward="torch", frozen=True, gas=1)
_case("z3-seed002-frozen-lin", stage=3, ckpt="non_reentrant", backward="engine", frozen="lin", gas=1)
_case("z3-seed002-noinputgrad", stage=3, ckpt="non_reentrant", backward="engine", frozen=True, gas=1,
      input_grad=False)
# the norms frozen only after deepspeed.initialize (and install): the release policy must see them
_case("z3-seed002-frozen-after-init", stage=3, ckpt="non_reentrant", backward="engine", frozen=True, gas=1,
      freeze_after_init=True)

WIDTH = 16
BLOCKS = 3
STEPS = 2
LR = 0.1


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _setup_dist() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def _build(case: dict[str, Any]):
    import torch
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Probe(torch.autograd.Function):
        """Identity; its backward records the status of ``params`` (runs after the consumer's backward)."""

        @staticmethod
        def forward(ctx, x, params, log):
            ctx.params, ctx.log = params, log
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            if torch._C._current_graph_task_id() != -1:
                ctx.log.append([str(getattr(p, "ds_status", "n/a")) for p in ctx.params])
            return g, None, None

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(WIDTH)
            self.lin = nn.Linear(WIDTH, WIDTH)
            self.log: list = []

        def forward(self, x):
            frozen = [p for p in self.parameters() if not p.requires_grad]
            if frozen and case["stage"] == 3:
                x = Probe.apply(x, frozen, self.log)
            return torch.tanh(self.lin(self.norm(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

        def forward(self, x):
            for b in self.blocks:
                x = b(x) if case["ckpt"] == "none" else checkpoint(b, x, use_reentrant=case["ckpt"] == "reentrant")
            return x

    torch.manual_seed(0)
    net = Net()
    frozen = case["frozen"]
    if frozen:
        for name, p in net.named_parameters():
            if (frozen is True and ".norm." in name) or (frozen == "lin" and ".lin." in name):
                p.requires_grad_(False)
    return net


def _loss_and_backward(out, kind: str, engine=None, scale: float = 1.0):

    if kind == "engine":
        engine.backward(out.float().pow(2).mean())
    elif kind == "torch":
        (out.float().pow(2).mean() * scale).backward()
    else:
        g = (2.0 / out.numel()) * out.detach() * scale
        out.backward(gradient=g)


def _reference(case: dict[str, Any], inputs: list) -> list:
    import torch

    net = _build(case)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    gas = case["gas"]
    for step in range(STEPS):
        for m in range(gas):
            x = inputs[step * gas + m].clone().requires_grad_(case.get("input_grad", True))
            out = net(x)
            (out.float().pow(2).mean() / gas).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def run_case(name: str, install: bool) -> dict[str, Any]:
    import torch
    import deepspeed
    import deepspeed.runtime.utils as ds_utils

    case = CASES[name]
    res: dict[str, Any] = {"case": name, "install": install, "deepspeed": deepspeed.__version__}
    gas = case["gas"]
    torch.manual_seed(1)
    inputs = [torch.randn(4, WIDTH) for _ in range(STEPS * gas)]
    ref = _reference(case, inputs)
    late = case.get("freeze_after_init", False)
    net = _build({**case, "frozen": False} if late else case)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": case["stage"], "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 0},
        "wall_clock_breakdown": False,
    }
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config, model_parameters=params)

    # Count count_used_parameters_in_backward calls per graph task, wherever the stage modules look it up.
    calls: list[int] = []
    mods = [sys.modules[m] for m in ("deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2")
            if m in sys.modules]
    originals = [(m, m.__dict__.get("count_used_parameters_in_backward")) for m in mods]

    def counting(*a, **k):
        calls.append(torch._C._current_graph_task_id())
        return ds_utils.count_used_parameters_in_backward(*a, **k)

    for m, orig in originals:
        if orig is not None:
            # deepspeed's stage modules, not typed: the name is there (``originals`` holds only those with it)
            m.count_used_parameters_in_backward = counting  # type: ignore[attr-defined]
    inst = None
    try:
        if install:
            from zerostate.runtime import install as zs_install

            inst = zs_install(engine)
            res["release_policy"] = inst.release_policy
            res["closures_replaced"] = len(inst.swaps)
        if late:
            for name, p in net.named_parameters():
                if ".norm." in name:
                    p.requires_grad_(False)
        per_backward, phase_violations = [], 0
        for step in range(STEPS):
            for micro in range(gas):
                x = inputs[step * gas + micro].clone().requires_grad_(case.get("input_grad", True))
                calls.clear()
                out = engine(x)
                _loss_and_backward(out, case["backward"], engine)  # DeepSpeed scales by 1/gas itself
                per_backward.append(len(calls))
                if len(calls) != len(set(calls)):
                    phase_violations += 1
                if case["stage"] == 3 and case["frozen"]:
                    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

                    gathered = [n for n, p in engine.module.named_parameters()
                                if not p.requires_grad and p.ds_status != ZeroParamStatus.NOT_AVAILABLE]
                    res.setdefault("gathered_after_backward", []).append(gathered)
                engine.step()  # DeepSpeed convention: every micro-batch; it steps at the boundary
        res["counts"] = max(per_backward) if per_backward else 0
        res["phase_violations"] = phase_violations
        if case["stage"] == 3 and case["frozen"]:
            res["after_last_use"] = sorted({s for b in engine.module.blocks for obs in b.log for s in obs})
        if case["stage"] == 3:
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                got = [p.detach().clone() for p in engine.module.parameters()]
        else:
            got = [p.detach().clone() for p in engine.module.parameters()]
        res["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=False))
    except Exception as e:  # noqa: BLE001 - report, do not stop the other cases
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        res["traceback"] = traceback.format_exc(limit=6)[-2000:]
    finally:
        for m, orig in originals:
            if orig is not None:
                m.count_used_parameters_in_backward = orig  # type: ignore[attr-defined]  # deepspeed's module
        if inst is not None:
            from zerostate.runtime import uninstall

            res["refreshes"] = inst.refreshes
            uninstall(engine)
        try:
            engine.destroy()
        except Exception as e:  # noqa: BLE001 -- teardown after the case's result is complete; nothing in it changes
            logging.getLogger("zerostate.runtime").debug("selfcheck: engine.destroy() failed: %s", e)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-install", action="store_true", help="run stock DeepSpeed")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--only", nargs="*", help="case names (or prefixes)")
    args = ap.parse_args(argv)
    _setup_dist()
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    names = [n for n in CASES if not args.only or any(n.startswith(o) for o in args.only)]
    results = []
    t0 = time.perf_counter()
    for n in names:
        r = run_case(n, install=not args.no_install)
        results.append(r)
        status = r.get("error") or f"max_diff={r['max_diff']:.2e} counts={r['counts']}"
        extra = f" after_last_use={r['after_last_use']}" if "after_last_use" in r else ""
        extra += f" gathered={r['gathered_after_backward']}" if any(r.get("gathered_after_backward", [])) else ""
        print(f"{n:32s} {status}{extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": time.perf_counter() - t0, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
