"""The rank pool: ``world_size`` persistent rank processes sharing one torch.distributed process group.

`RankPool` starts ``world_size`` rank processes (`rank_worker`) once per target, with one rendezvous
(gloo on CPU, nccl on GPUs) that lives as long as the pool.  The pool's own process hosts the rendezvous
store (`host_store`: a ``TCPStore`` the OS binds to a free port and that stays bound while the pool lives;
the ranks connect as clients, ``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent): a port picked
free and bound later by rank 0 could be taken meanwhile by another pool's store, whose rendezvous a rank
would then join.  `RankPool.request` sends the *same* request to every rank and collects every rank's answer, with
the per-train-step progress lines (parameter checksums) in between; it has `worker_process.Worker`'s methods, so
`ranks.DeepSpeedRanksTarget` drives it as `DeepSpeedTarget` drives one worker (`worker_process.WorkerLike`).

Hangs: a rank that sends nothing for ``timeout`` seconds (per train step: every step's report resets
its clock) raises `RankTimeout`, whose message holds the stacks of the stuck ranks (``SIGUSR1`` ->
faulthandler).  No rank outlives the run: each runs in a session of its own and is killed by process
group (``killpg``) on close, on restart and at exit (``atexit``), and dies with its parent by
``PR_SET_PDEATHSIG`` when the parent is killed outright.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any, cast

from zerostate.harness import envs
from zerostate.harness.forked import start_child
from zerostate.harness.worker_process import WorkerDied, WorkerTimeout
from zerostate.harness.protocol import RankRecord, Request, Response, StepProgress

_POOLS: set[RankPool] = set()
"""Every pool not closed yet (a strong reference: ``atexit`` must find a pool whose target never finished
constructing, e.g. Ctrl-C during start-up)."""


def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close(kill=True)


atexit.register(_close_all)


def free_port() -> int:
    """A port free now (another process may bind it before the caller does: `host_store` where that matters)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store(world_size: int) -> Any:
    """A rendezvous store for ``world_size`` ranks, served from this process on a port bound here and held
    for the store's life (its ``port``); the ranks join it with ``TORCHELASTIC_USE_AGENT_STORE=True``."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=STORE_TIMEOUT))


STORE_TIMEOUT = 1800
"""Seconds a rank waits on the store for a key (torch's default): the pool's own timeouts end hangs first."""

HELLO_GRACE = 60.0
"""Seconds the pool still waits for the other ranks' hello once a rank answered it with a failure: they may be
blocked in a collective of the start-up the failed rank never reaches."""


RAISED_GRACE = 10.0
"""Seconds the pool still waits for the other ranks of a run once one rank's run ended on an exception: the others
may be blocked in a collective the raising rank left (a DeepSpeed error raised on some ranks only), and the hang is
then that exception's (`RankTimeout.raised`)."""


def raised_run(resp: Response) -> bool:
    """A rank's answer to a run whose record ended on an exception (the executor records it and answers ok)."""
    result = resp.get("result")
    return bool(resp.get("ok")) and isinstance(result, dict) and bool(result.get("raised"))


class RankTimeout(WorkerTimeout):
    """No report from a rank within the step timeout; the message holds the stuck ranks' stacks.  ``raised``: the
    answer of the first rank whose run ended on an exception, if one did (the others waited on it)."""

    def __init__(self, message: str, raised: Response | None = None) -> None:
        super().__init__(message)
        self.raised = raised


class _Rank:
    def __init__(self, rank: int, env: dict[str, str], log_path: Path, stacks_path: Path, cwd: str) -> None:
        self.rank, self.log_path, self.stacks_path = rank, log_path, stacks_path
        self._log = open(log_path, "ab")  # noqa: SIM115 -- the rank's stderr for its whole life; close() closes it
        stacks_path.write_text("")
        self.proc = start_child("rank_worker", env, Path(cwd), self._log, session=True, log_dir=log_path.parent)
        self.stdin: IO[bytes] = self.proc.stdin
        self.stdout: IO[bytes] = self.proc.stdout
        self.buf = b""

    def send(self, obj: Request) -> None:
        try:
            self.stdin.write((json.dumps(obj) + "\n").encode())
            self.stdin.flush()
        except OSError:  # BrokenPipeError included
            raise WorkerDied(f"rank {self.rank} exited (code {self.proc.poll()})") from None

    def lines(self) -> list[dict[str, Any]]:
        """The complete lines received so far: `StepProgress` lines and the final answer."""
        out = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                out.append(json.loads(line))
        return out

    def signal_stacks(self) -> int | None:
        """Ask for every thread's stack (faulthandler on SIGUSR1); the offset it will be written at."""
        try:
            start = self.stacks_path.stat().st_size
            os.kill(self.proc.pid, signal.SIGUSR1)
            return start
        except OSError:
            return None

    def read_stacks(self, start: int | None) -> str:
        if start is None:
            return "(process gone)"
        with open(self.stacks_path, "rb") as fh:
            fh.seek(start)
            return fh.read().decode(errors="replace").strip() or "(no stack written)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill(group=True)  # the rank and anything it started
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def close_files(self) -> None:
        self.proc.close()
        self._log.close()


class RankPool:
    """``world_size`` rank processes sharing one process group; a `worker_process.WorkerLike`."""

    def __init__(self, env: dict[str, str], world_size: int, log_path: Path, cwd: Path | None = None) -> None:
        self.world_size = world_size
        self.log_path = log_path
        cwd = cwd or envs.cache_root()
        cwd.mkdir(parents=True, exist_ok=True)
        self.ranks: list[_Rank] = []
        self._sel = selectors.DefaultSelector()
        self._store: Any = None
        _POOLS.add(self)
        try:
            self._store = host_store(world_size)
            port = str(self._store.port)
            for r in range(world_size):
                e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                         LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                         TORCHELASTIC_USE_AGENT_STORE="True",
                         ZEROSTATE_PARENT_PID=str(os.getpid()),
                         ZEROSTATE_STACKS=str(log_path.with_suffix(f".rank{r}.stacks")))
                rk = _Rank(r, e, log_path.with_suffix(f".rank{r}.log"), log_path.with_suffix(f".rank{r}.stacks"),
                           str(cwd))
                self.ranks.append(rk)
                self._sel.register(rk.stdout, selectors.EVENT_READ, rk)
        except BaseException:
            self.close(kill=True)
            raise

    @property
    def forked(self) -> bool:
        return bool(self.ranks) and all(rk.proc.forked for rk in self.ranks)

    @property
    def pids(self) -> list[int]:
        return [rk.proc.pid for rk in self.ranks]

    def alive(self) -> bool:
        return bool(self.ranks) and all(rk.proc.poll() is None for rk in self.ranks)

    def log_tail(self, n: int = 3000) -> str:
        parts = []
        for rk in self.ranks:
            try:
                data = rk.log_path.read_bytes()[-max(n // self.world_size, 200):]
            except OSError:
                data = b""
            parts.append(f"--- rank {rk.rank} log ---\n{data.decode(errors='replace')}")
        return "\n".join(parts)

    def request(self, obj: Request, timeout: float) -> Response:
        """Send ``obj`` to every rank; wait for each rank's answer, allowing ``timeout`` seconds between
        two reports of one rank.  Returns rank 0's answer (or the first failing rank's) with
        ``"ranks": [{"rank", "ok", "result", "steps": [digests per step], "error"}, ...]``."""
        for rk in self.ranks:
            rk.send(obj)
        now = time.monotonic()
        last = {rk.rank: now for rk in self.ranks}
        final: dict[int, Response] = {}
        steps: dict[int, list[dict[str, str]]] = {rk.rank: [] for rk in self.ranks}
        graced = False
        while len(final) < len(self.ranks):
            now = time.monotonic()
            if obj.get("op") == "run" and not graced and any(raised_run(a) for a in final.values()):
                graced = True  # a rank raised: the others have RAISED_GRACE from now on, not the step timeout
                timeout = min(timeout, RAISED_GRACE)
                last = dict.fromkeys(last, now)
            if obj.get("op") == "hello" and timeout > HELLO_GRACE and any(not a.get("ok") for a in final.values()):
                # a rank failed to start: the others may wait on it forever; they get HELLO_GRACE from now on
                timeout = HELLO_GRACE
                last = dict.fromkeys(last, now)
            late = [rk for rk in self.ranks if rk.rank not in final and now - last[rk.rank] > timeout]
            if late:
                cause = next((final[r] for r in sorted(final) if raised_run(final[r])), None)
                raise RankTimeout(self._hang_message(late, final, steps, timeout), cause)
            wait = min(timeout - (now - last[rk.rank]) for rk in self.ranks if rk.rank not in final)
            for key, _ in self._sel.select(max(wait, 0.01)):
                rk = cast(_Rank, key.data)
                chunk = os.read(rk.stdout.fileno(), 1 << 20)
                if not chunk:
                    try:
                        rk.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    raise WorkerDied(f"rank {rk.rank} exited (code {rk.proc.returncode}) while "
                                     f"{len(final)} of {self.world_size} ranks had answered")
                rk.buf += chunk
                last[rk.rank] = time.monotonic()
                for msg in rk.lines():
                    if msg.get("progress") == "step":
                        steps[rk.rank].append(cast(StepProgress, msg)["digests"])
                    else:
                        final[rk.rank] = cast(Response, msg)
        ranks: list[RankRecord] = [{"rank": r, "ok": final[r].get("ok"), "result": final[r].get("result"),
                                    "steps": steps[r], "error": final[r].get("error")} for r in sorted(final)]
        bad = [final[r] for r in sorted(final) if not final[r].get("ok")]
        resp: Response = {**(bad[0] if bad else final[0])}
        resp["ranks"] = ranks
        if obj.get("op") == "run":  # what the run cost: every rank's share
            resp["cpu_seconds"] = sum(float(final[r].get("cpu_seconds") or 0.0) for r in final)
            resp["oracle_seconds"] = sum(float(final[r].get("oracle_seconds") or 0.0) for r in final)
        syncs = [final[r].get("sync") for r in sorted(final)]
        if obj.get("op") == "run" and (bad or any(s != syncs[0] for s in syncs[1:])):
            resp["desync"] = "; ".join(f"rank {r}: {final[r].get('sync')}" for r in sorted(final)) if not bad else \
                "a rank failed"
        return resp

    def _hang_message(self, late: list[_Rank], final: dict[int, Response], steps: dict[int, list[dict[str, str]]],
                      timeout: float) -> str:
        who = ", ".join(f"rank {rk.rank} (after {len(steps[rk.rank])} train step(s))" for rk in late)
        done = ", ".join(f"rank {r}" for r in sorted(final)) or "none"
        parts = [f"no report within {timeout:.0f} s from {who}; finished: {done}"]
        for r in sorted(final):  # a rank that answered with a failure is likely why the others wait
            if not final[r].get("ok"):
                parts.append(f"--- rank {r} answered: {final[r].get('error')} ---\n"
                             f"{_trim(str(final[r].get('traceback') or ''))}")
            elif raised_run(final[r]):
                raised = cast(dict, final[r].get("result") or {}).get("raised") or {}
                parts.append(f"--- rank {r}'s run raised: {raised.get('text')} ---")
        starts = [rk.signal_stacks() for rk in late]
        time.sleep(1.0)  # faulthandler writes from the signal handler, even inside a blocked collective
        for rk, start in zip(late, starts, strict=True):
            parts.append(f"--- stacks of rank {rk.rank} (pid {rk.proc.pid}) ---\n{_trim(rk.read_stacks(start))}")
        return "\n".join(parts)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for rk in self.ranks:
                if rk.proc.poll() is None:
                    try:
                        rk.send({"op": "exit"})
                    except WorkerDied:
                        pass
            deadline = time.monotonic() + 10
            for rk in self.ranks:
                try:
                    rk.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        for rk in self.ranks:
            rk.kill()
            rk.close_files()
        self._sel.close()
        self.ranks = []
        self._store = None  # the store's server stops with its last reference
        _POOLS.discard(self)


def _trim(stack: str, keep: int = 30) -> str:
    """faulthandler's dump, with zerostate's own thread frames first; at most ``keep`` lines per thread."""
    out, n = [], 0
    for ln in stack.splitlines():
        if ln.startswith(("Thread", "Current thread")):
            n = 0
        n += 1
        if n <= keep:
            out.append(ln)
    return "\n".join(out)


__all__ = ["RAISED_GRACE", "RankPool", "RankTimeout", "free_port", "host_store", "raised_run"]
