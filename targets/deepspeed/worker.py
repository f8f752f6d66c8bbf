"""The persistent worker: one interpreter, one DeepSpeed release, many scenarios.

Started by `zerostate.targets.deepspeed.target.DeepSpeedTarget` as
``python -m zerostate.targets.deepspeed.worker`` with ``PYTHONPATH`` pointing at
the release to load (a cached ``pip install --target`` directory or a local
checkout) and its own ``TORCH_EXTENSIONS_DIR``.  It speaks JSON lines: one
request per line on stdin, one response per line on the protocol stream (the
original stdout; everything DeepSpeed prints goes to stderr).

Requests and responses::

    {"op": "hello"}                -> {"ok": true, "deepspeed": "0.19.8", "file": ..., "torch": ...,
                                       "device": "cpu", "rank": 0, "world_size": 1}
    {"op": "run", "scenario": {...}} -> {"ok": true, "result": <executor.execute dict>, "seconds": s}
    {"op": "exit"}                 -> (exits)

A failure to import DeepSpeed or to initialise torch.distributed is answered
``{"ok": false, "error": ...}`` to the first request.  torch.distributed is
initialised once (gloo on CPU, nccl on CUDA) from ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT``: world size 2 will start two workers with the
same rendezvous and send each the same request, in lockstep.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # DeepSpeed's prints and logs go to stderr, never into the protocol
    sys.stdout = sys.stderr

    def reply(obj) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    hello = None
    try:
        from . import compat, net
        import torch
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not torch.cuda.is_available():
            compat.skip_shm_comm_op()
        net.setup_distributed()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # tiny tensors: threads only cost
        from . import executor
        hello = {"ok": True, "deepspeed": deepspeed.__version__, "file": deepspeed.__file__,
                 "torch": torch.__version__, "device": "cuda" if torch.cuda.is_available() else "cpu",
                 "rank": int(os.environ.get("RANK", 0)), "world_size": int(os.environ.get("WORLD_SIZE", 1))}
    except BaseException as exc:  # noqa: BLE001 - report anything, including SystemExit from imports
        hello = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": "".join(traceback.format_exc().splitlines(True)[-15:])}
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        op = req.get("op")
        if op == "exit":
            break
        if not hello.get("ok") or op == "hello":
            reply(hello)
            continue
        if op == "run":
            t0 = time.perf_counter()
            if req.get("sleep"):  # test hook: simulate a hang
                time.sleep(float(req["sleep"]))
            try:
                result = executor.execute(req["scenario"])
                reply({"ok": True, "result": result, "seconds": time.perf_counter() - t0})
            except BaseException as exc:  # noqa: BLE001
                reply({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": "".join(traceback.format_exc().splitlines(True)[-15:])})
        else:
            reply({"ok": False, "error": f"unknown op {op!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
