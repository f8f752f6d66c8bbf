#!/usr/bin/env python3
"""ZeRO-1 + bf16 + grad_accum_dtype fp32 + optimizer offload, two ranks: two backwards of one forward
(retain_graph=True) in the boundary micro-step.  The ZeRO-1 branch of reduce_ipg_grads keeps each rank's
fp32 ``grad_accum`` of the parameters outside its partition (divided by the world size in place by
average_tensor), so the second backward adds to it and sends it again.

    torchrun --nproc-per-node 2 repro_minimal.py      (CPU, gloo; needs only torch and deepspeed)

Prints, per parameter, the partitions holding it and DeepSpeed's fp32 master update over the correct one
(SGD, lr 1: minus the mean over the ranks of each rank's gradient of its own rows); exits 1 while a parameter
is off by more than 1 %, 0 once fixed.  With the bug, a parameter held by one rank's partition gets the
other rank's share 0.625 times instead of 0.5 times.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))


def loss_of(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).float().pow(2).mean()


def main() -> int:
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1)).bfloat16()  # the global batch
    mine = x.chunk(world)[rank]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"},
              "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
              "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}
    net = model()
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0), config=config)
    before = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}

    loss = loss_of(engine, mine)
    engine.backward(0.5 * loss, retain_graph=True)  # two backwards of one forward, one step
    engine.backward(0.5 * loss)
    engine.step()
    got = {n: safe_get_full_fp32_param(p) - before[n] for n, p in engine.module.named_parameters()}

    # the correct update: minus the mean of the ranks' gradients, each of its own rows, in bf16 as DeepSpeed computes
    ref = model().bfloat16()
    want = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
    for rows in x.chunk(world):
        ref.zero_grad()
        loss_of(ref, rows).backward()
        for n, p in ref.named_parameters():
            want[n] -= p.grad.float() / world

    optimizer = engine.optimizer
    bad = 0
    if rank == 0:
        print(f"DeepSpeed {deepspeed.__version__}, world size {world}")
    for n, p in engine.module.named_parameters():
        held = sorted(optimizer.param_to_partition_ids[0][optimizer.get_param_id(p)])
        ratio = float((got[n] * want[n]).sum() / (want[n] * want[n]).sum())
        err = float((got[n] - want[n]).norm() / want[n].norm())
        bad += err > 0.01
        if rank == 0:
            print(f"  {n:10s} in partition(s) {held}: update / correct update = {ratio:.3f} (relative error {err:.3f})")
    if rank == 0:
        print("BUG PRESENT" if bad else "OK")
    dist.barrier()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
