"""torch.distributed as the network sees it: start-up (`setup_distributed`), this rank, its rows of the
global batch (`rank_rows`), a barrier and a directory every rank shares."""

from __future__ import annotations

import os
import re
import socket
import tempfile
import warnings

import torch
import torch.distributed as dist


def setup_distributed() -> None:
    """World size 1 on CPU (gloo) unless launched by the deepspeed launcher / on a GPU (nccl)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    warnings.filterwarnings("ignore")
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_of() -> int:
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def barrier() -> None:
    if _initialized() and dist.get_world_size() > 1:
        dist.barrier()


CKPT_PREFIX = "zerostate-ckpt-"
_CKPT_PATH = re.compile(r"/\S*?" + CKPT_PREFIX + r"[A-Za-z0-9_]+")


def without_tmpdir(text: str) -> str:
    """``text`` with each checkpoint directory `shared_tmpdir` made named ``<checkpoint dir>``: an error that
    quotes a path in it reads the same in every run (two runs of one example, a local and a cluster run)."""
    return _CKPT_PATH.sub("<checkpoint dir>", text)


def shared_tmpdir() -> str:
    """A temporary directory every rank uses (rank 0 makes it and sends its path): a DeepSpeed checkpoint
    is one directory, rank 0's model states read by every rank at load."""
    path = [tempfile.mkdtemp(prefix=CKPT_PREFIX) if not rank_of() else None]
    if _initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(path, src=0)
    assert path[0] is not None
    return path[0]


def rank_rows(x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the global batch (world size > 1; else ``x``).  The oracle trains on the whole
    batch; each rank's loss is the mean over its equal share, and data-parallel averaging of the gradients
    makes the mean of the per-rank means: the gradient of the global batch's mean."""
    ws = world_size()
    if ws == 1:
        return x
    rank = dist.get_rank()
    if x.shape[0] % ws:
        raise ValueError(f"batch of {x.shape[0]} rows cannot be split evenly over {ws} ranks")
    return x.detach().chunk(ws)[rank].clone().requires_grad_(x.requires_grad)


__all__ = ["CKPT_PREFIX", "barrier", "rank_of", "rank_rows", "setup_distributed", "shared_tmpdir", "without_tmpdir",
           "world_size"]
