"""One rank of the rank pool (`rank_pool.RankPool`): a persistent JSON-lines worker at world size > 1.

Started by the pool as ``python -m zerostate.harness.rank_worker`` with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (one rendezvous for the
pool's lifetime: torch.distributed is initialised once, gloo on CPU, nccl on GPUs), in a session
of its own, and dies with its parent (``PR_SET_PDEATHSIG``).  ``SIGUSR1`` makes it write the stack
of every thread to ``$ZEROSTATE_STACKS`` (faulthandler; works while a thread is blocked in a
collective).  The loop and the start-up are `worker_loop`'s; the protocol is `worker`'s, plus one
progress line per train step::

    {"op": "hello"}                  -> {"ok": true, "deepspeed": ..., "rank": r, "world_size": n, ...}
    {"op": "run", "scenario": {...}} -> {"progress": "step", "step": i, "digests": {param: sha1}} per step,
                                        then {"ok": true, "result": <executor.execute dict>, "seconds": s}
    {"op": "exit"}                   -> (exits)

The pool waits for a warm-up example (imports) before the first request is answered.
The final answer also carries ``"sync"``: each process group's collective sequence number, which the
pool compares across ranks (ranks out of step are restarted before the next example).
A request may carry ``"stall": {"rank": r, "seconds": s}`` (tests): rank ``r`` sleeps ``s`` seconds
before the run, so the other ranks block in the first collective -- a simulated hang; and
``"unmatched": r``: rank ``r`` issues one extra collective after the run (ranks out of step).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import time

from zerostate.harness.cross_rank_checks import digests
from zerostate.harness.worker_loop import failure, open_protocol, serve, start_deepspeed

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it exits, however it exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except Exception:  # pragma: no cover - not Linux: the parent's atexit and killpg remain
        pass
    ppid = os.environ.get("ZEROSTATE_PARENT_PID")
    if ppid and os.getppid() != int(ppid):  # the parent died before prctl took effect
        os._exit(1)


def sync_state() -> dict[str, int]:
    """Each process group's collective sequence number on this rank (by group name).  Ranks that issued
    different numbers of collectives in an example (one raised before a collective the other issued)
    are out of step: the next example's collectives would pair wrongly (garbage, not a DeepSpeed bug)."""
    try:
        from torch.distributed import distributed_c10d as c10d
        out = {}
        for pg, name in list(c10d._world.pg_names.items()):
            try:
                out[str(name)] = int(pg._get_sequence_number_for_group())
            except Exception:
                pass
        return out
    except Exception:  # pragma: no cover
        return {}


def main() -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it tears the pool down
    reply = open_protocol()
    stacks = os.environ.get("ZEROSTATE_STACKS")
    if stacks:
        faulthandler.register(signal.SIGUSR1, file=open(stacks, "a"), all_threads=True)
    rank = int(os.environ.get("RANK", "0"))
    try:
        hello = start_deepspeed(skip_shm_comm=True)
        from zerostate.harness import executor
        import torch
        import torch.distributed as dist
        if os.environ.get("ZEROSTATE_RANK_WARMUP", "1") != "0":
            # One tiny ZeRO-3 example on every rank before the pool answers hello: the lazy imports of the
            # first deepspeed.initialize (seconds) must not count against the first example's step timeout.
            executor.execute({"blocks": [{"checkpoint": "non_reentrant"}], "stage": 3,
                              "steps": [{"micro": [{"backward": "engine"}]}]})
        hello.update(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=dist.get_backend())
    except BaseException as exc:  # noqa: BLE001
        hello = failure(exc, f"rank {rank}: ")

    def run(req: dict, reply) -> dict:
        t0 = time.perf_counter()
        stall = req.get("stall") or {}
        if stall and int(stall.get("rank", -1)) == rank:
            time.sleep(float(stall.get("seconds", 0)))

        def on_step(i, got):
            reply({"progress": "step", "step": i, "digests": digests(got)})
        result = executor.execute(req["scenario"], on_step=on_step)
        if req.get("unmatched") == rank:  # tests: one collective the other ranks never issue
            dist.all_reduce(torch.zeros(1), async_op=True)
        return {"ok": True, "result": result, "seconds": time.perf_counter() - t0, "sync": sync_state()}

    return serve(hello, run, reply, error_prefix=f"rank {rank}: ")


if __name__ == "__main__":
    sys.exit(main())
