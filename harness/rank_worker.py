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
                                        then {"ok": true, "result": <the RunRecord, wire.to_wire>, "seconds": s}
    {"op": "exit"}                   -> (exits)

The pool waits for a warm-up example (imports) before the first request is answered.
``ZEROSTATE_RANK_START_FAILS=r:PATH`` (tests): while ``PATH`` exists, rank ``r`` removes it and answers its
hello with a failure before the rendezvous, so the other ranks wait in it -- a start that fails once.
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
from typing import Protocol, runtime_checkable

from zerostate.harness.cross_rank_checks import digests
from zerostate.harness.net.compare import Params
from zerostate.harness.protocol import Failure, Hello, RunAnswer, RunRequest
from zerostate.harness.worker_loop import Reply, RunClock, failure, open_protocol, serve, start_deepspeed
from zerostate.model.scenario import Block, Checkpoint, Scenario

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it exits, however it exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux: the parent's atexit and killpg remain
        pass
    ppid = os.environ.get("ZEROSTATE_PARENT_PID")
    if ppid and os.getppid() != int(ppid):  # the parent died before prctl took effect
        os._exit(1)


@runtime_checkable
class _Sequenced(Protocol):
    """A process group that counts its collectives."""

    def _get_sequence_number_for_group(self) -> int: ...


def sync_state() -> dict[str, int]:
    """Each process group's collective sequence number on this rank (by group name).  Ranks that issued
    different numbers of collectives in an example (one raised before a collective the other issued)
    are out of step: the next example's collectives would pair wrongly (garbage, not a DeepSpeed bug)."""
    from torch.distributed import distributed_c10d as c10d
    try:
        groups = list(c10d._world.pg_names.items())
    except AttributeError:  # pragma: no cover - a torch without the private registry: nothing compared
        return {}
    out = {}
    for pg, name in groups:
        if not isinstance(pg, _Sequenced):  # a backend without sequence numbers: that group is not compared
            continue
        try:
            out[str(name)] = int(pg._get_sequence_number_for_group())
        except RuntimeError:  # ... or one that has the method and refuses
            continue
    return out


def _fail_start_once(rank: int) -> None:
    spec = os.environ.get("ZEROSTATE_RANK_START_FAILS")
    if spec:
        who, path = spec.split(":", 1)
        if int(who) == rank and os.path.exists(path):
            os.remove(path)
            raise RuntimeError(f"rank {rank} was told to fail its start ({path})")


def main() -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it tears the pool down
    reply = open_protocol()
    stacks = os.environ.get("ZEROSTATE_STACKS")
    if stacks:
        # the stacks file stays open for the process's life: faulthandler writes to it on SIGUSR1
        faulthandler.register(signal.SIGUSR1, file=open(stacks, "a"), all_threads=True)  # noqa: SIM115
    rank = int(os.environ.get("RANK", "0"))
    hello: Hello | Failure
    try:
        _fail_start_once(rank)
        hello = start_deepspeed(skip_shm_comm=True)
        from zerostate.harness.executor import execute
        import torch
        import torch.distributed as dist
        if os.environ.get("ZEROSTATE_RANK_WARMUP", "1") != "0":
            # One tiny ZeRO-3 example on every rank before the pool answers hello: the lazy imports of the
            # first deepspeed.initialize (seconds) must not count against the first example's step timeout.
            execute(Scenario(blocks=(Block(checkpoint=Checkpoint.NON_REENTRANT),), stage=3))
        hello["rank"], hello["world_size"] = dist.get_rank(), dist.get_world_size()
        hello["backend"] = str(dist.get_backend())
    except BaseException as exc:  # noqa: BLE001
        hello = failure(exc, f"rank {rank}: ")

    def run(req: RunRequest, reply: Reply) -> RunAnswer:
        clock = RunClock()
        stall = req.get("stall")
        if stall and int(stall["rank"]) == rank:
            time.sleep(float(stall["seconds"]))

        def on_step(i: int, got: Params) -> None:
            reply({"progress": "step", "step": i, "digests": digests(got)})
        record = execute(Scenario.from_dict(req["scenario"]), on_step=on_step,
                         perturb=tuple((str(n), float(f)) for n, f in req.get("perturb") or ()),
                         timing=clock.timing)
        if req.get("unmatched") == rank:  # tests: one collective the other ranks never issue
            dist.all_reduce(torch.zeros(1), async_op=True)
        answer = clock.answer(record)
        answer["sync"] = sync_state()
        return answer

    return serve(hello, run, reply, error_prefix=f"rank {rank}: ")


if __name__ == "__main__":
    sys.exit(main())
