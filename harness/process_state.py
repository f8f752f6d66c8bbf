"""What a worker process holds before its first run: `global_state`, for comparing a forked worker with a started one.

A forked worker (`fork_server`) must be as fresh as a started one: the worker loop answers ``{"op": "state"}``
with this description, and a test compares the two.  It names the state a run could inherit: the process
group, DeepSpeed's communication backend, accelerator and ZeRO-Init globals (the tensor constructors and
``F.linear`` it overrides), torch's threads and generator, the random generators' first draws (each process
its own), gc, threads, signal handlers, the environment and the working directory.
"""

from __future__ import annotations

import gc
import hashlib
import os
import random
import signal
import sys
import threading
from typing import Any

PER_PROCESS_ENV = ("MASTER_PORT", "ZEROSTATE_PARENT_PID", "ZEROSTATE_FORKED", "ZEROSTATE_STACKS")
"""Variables every worker has its own value of (its rendezvous port, the process it dies with, whether and from
what it was forked): a comparison of two workers leaves them out."""


def _name(obj: object) -> str:
    if isinstance(obj, signal.Handlers):  # SIG_DFL / SIG_IGN
        return obj.name
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def global_state() -> dict[str, Any]:
    """This process's global state, as plain JSON (see the module's docstring)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.accelerator import real_accelerator
    from deepspeed.comm import comm as ds_comm
    from deepspeed.runtime.zero import partition_parameters as pp

    state: dict[str, Any] = {
        "dist": [dist.is_initialized(), dist.get_world_size() if dist.is_initialized() else None,
                 str(dist.get_backend()) if dist.is_initialized() else None],
        "deepspeed_comm": type(ds_comm.cdb).__name__ if ds_comm.cdb is not None else None,
        "accelerator": type(real_accelerator.ds_accelerator).__name__,
        "zero_init_context": pp.zero_init_context,
        "top_level_context": pp.top_level_context is not None,
        "constructors": [_name(f) for f in (torch.tensor, torch.empty, torch.zeros, torch.ones, torch.full)],
        "linear": _name(F.linear),
        "torch_threads": torch.get_num_threads(),
        "torch_seed": torch.initial_seed(),
        "torch_rng": hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "python_random": random.random(),
        "gc": [gc.isenabled(), gc.get_freeze_count() > 0],
        "threads": sorted(t.name for t in threading.enumerate()),
        "signals": {s.name: _name(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD,
                                                                  signal.SIGUSR1)},
        "env": dict(sorted(os.environ.items())),
        "cwd": os.getcwd(),
        "hypothesis": "hypothesis" in sys.modules,
    }
    if "numpy" in sys.modules:
        state["numpy_random"] = float(sys.modules["numpy"].random.random())
    return state


__all__ = ["PER_PROCESS_ENV", "global_state"]
