"""The persistent worker: one interpreter, one DeepSpeed release, many scenarios.

Started by `zerostate.targets.deepspeed.target.DeepSpeedTarget` as
``python -m zerostate.harness.worker`` with ``PYTHONPATH`` pointing at
the release to load (a cached ``pip install --target`` directory or a local
checkout) and its own ``TORCH_EXTENSIONS_DIR``.  It speaks JSON lines: one
request per line on stdin, one response per line on the protocol stream (the
original stdout; everything DeepSpeed prints goes to stderr).  The loop and the start-up are
`worker_loop`'s, shared with the rank pool's `rank_worker`.

Requests and responses::

    {"op": "hello"}                -> {"ok": true, "deepspeed": "0.19.8", "file": ..., "torch": ...,
                                       "device": "cpu", "rank": 0, "world_size": 1}
    {"op": "run", "scenario": {...}} -> {"ok": true, "result": <the RunRecord, wire.to_wire>, "seconds": s,
                                         "cpu_seconds": c, "oracle_seconds": o}
    {"op": "exit"}                 -> (exits)

A failure to import DeepSpeed or to initialise torch.distributed is answered
``{"ok": false, "error": ...}`` to the first request.  torch.distributed is
initialised once (gloo on CPU, nccl on CUDA) from ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT``: world size 2 will start two workers with the
same rendezvous and send each the same request, in lockstep.  The payloads are `protocol`'s; the
scenario is parsed here, once (``Scenario.from_dict``), and the executor takes the typed value.
"""

from __future__ import annotations

import os
import sys
import time

from zerostate.harness.protocol import Failure, Hello, RunAnswer, RunRequest
from zerostate.harness.worker_loop import Reply, RunClock, failure, open_protocol, serve, start_deepspeed
from zerostate.model.scenario import Scenario


def main() -> int:
    reply = open_protocol()
    hello: Hello | Failure
    try:
        hello = start_deepspeed(skip_shm_comm=int(os.environ.get("WORLD_SIZE", "1")) == 1)
        from zerostate.harness.executor import execute
        hello["rank"], hello["world_size"] = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except BaseException as exc:  # noqa: BLE001 - report anything, including SystemExit from imports
        hello = failure(exc)

    def run(req: RunRequest, reply: Reply) -> RunAnswer:
        clock = RunClock()
        if req.get("sleep"):  # test hook: simulate a hang
            time.sleep(float(req["sleep"]))
        record = execute(Scenario.from_dict(req["scenario"]),
                         perturb=tuple((str(n), float(f)) for n, f in req.get("perturb") or ()), timing=clock.timing)
        return clock.answer(record)

    return serve(hello, run, reply)


if __name__ == "__main__":
    sys.exit(main())
