"""Several ranks: real DeepSpeed on a real torch.distributed process group, checked across ranks.

::

    t = get_target("deepspeed", deepspeed="0.19.2", world_size=2)   # a DeepSpeedRanksTarget
    outcome = t.run(scenario); t.close()

`RankPool` starts ``world_size`` rank processes (`rank_worker`) once per target, with one
rendezvous (``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``; gloo on CPU, nccl on GPUs) that
lives as long as the pool.  Every example sends the *same* scenario to every rank; the ranks run it
in lockstep (their collectives tie them together), each on its equal share of the global batch
(`net.rank_rows`), and each reports the checksums of the gathered parameters after every train
step, then its trace and result.  The parent (Hypothesis drives it, as at world size 1) compares:

* ``ranks-trace``   -- every rank saw the same module trace (ZeRO-3 module hooks and recompute
  blocks, with their phase) and the same parameter order (fetch / prefetch / release), step by step;
* ``ranks-params``  -- the gathered parameters agree, bit for bit, across ranks after every step;
* ``ranks-outcome`` -- every rank finished, or every rank raised the same exception;
* ``oracle``        -- each rank's parameters equal plain PyTorch trained on the global batch
  (rank 0's comparison is the target's; another rank's is reported when rank 0's agrees);
* everything `DeepSpeedTarget` checks, on rank 0's trace.

Ranks out of step: each rank reports every process group's collective sequence number after an
example; when they differ (one rank raised before a collective another issued), the next example's
collectives would pair wrongly and produce garbage, so the pool is restarted first
(``desync_restarts``; ``details["pool_restarted"]``).  Ranks that both raise at the same point stay in
step and keep the pool.

Hangs: a rank that sends nothing for ``timeout`` seconds (per train step: every step's report resets
its clock) is a ``hang`` finding, with the stacks of the stuck ranks (``SIGUSR1`` -> faulthandler);
the pool is killed and restarted.  No rank outlives the run: each runs in a session of its own and is
killed by process group (``killpg``) on close, on restart and at exit (``atexit``), and dies with its
parent by ``PR_SET_PDEATHSIG`` when the parent is killed outright.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zerostate.model.events import Event
from zerostate.model.scenario import Scenario

from ..base import Finding, Outcome, TargetError
from . import envs
from .target import DeepSpeedTarget, WorkerDied, WorkerTimeout

CROSS_CHECKS = ("ranks-trace", "ranks-params", "ranks-outcome")
MODULE_KINDS = {"module_pre_forward", "module_post_forward", "module_pre_backward", "module_post_backward",
                "recompute_start", "recompute_end"}
PARAM_KINDS = {"fetch", "prefetch", "release"}

_POOLS: "set[RankPool]" = set()
"""Every pool not closed yet (a strong reference: ``atexit`` must find a pool whose target never finished
constructing, e.g. Ctrl-C during start-up)."""


def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close(kill=True)


atexit.register(_close_all)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankTimeout(WorkerTimeout):
    """No report from a rank within the step timeout; the message holds the stuck ranks' stacks."""


class _Rank:
    def __init__(self, rank: int, env: dict[str, str], log_path: Path, stacks_path: Path, cwd: str):
        self.rank, self.log_path, self.stacks_path = rank, log_path, stacks_path
        self._log = open(log_path, "ab")
        stacks_path.write_text("")
        self.proc = subprocess.Popen([sys.executable, "-m", "zerostate.targets.deepspeed.rank_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     cwd=cwd, start_new_session=True)
        self.buf = b""

    def send(self, obj: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerDied(f"rank {self.rank} exited (code {self.proc.poll()})") from None

    def lines(self) -> list[dict]:
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
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the rank and anything it started
            except OSError:
                self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def close_files(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self._log):
            try:
                f.close()
            except Exception:
                pass


class RankPool:
    """``world_size`` rank processes sharing one process group; duck-types `target.Worker`."""

    def __init__(self, env: dict[str, str], world_size: int, log_path: Path):
        self.world_size = world_size
        self.log_path = log_path
        cwd = envs.cache_root()
        cwd.mkdir(parents=True, exist_ok=True)
        port = str(free_port())
        self.ranks: list[_Rank] = []
        self._sel = selectors.DefaultSelector()
        _POOLS.add(self)
        try:
            for r in range(world_size):
                e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                         LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                         ZEROSTATE_PARENT_PID=str(os.getpid()),
                         ZEROSTATE_STACKS=str(log_path.with_suffix(f".rank{r}.stacks")))
                rk = _Rank(r, e, log_path.with_suffix(f".rank{r}.log"), log_path.with_suffix(f".rank{r}.stacks"),
                           str(cwd))
                self.ranks.append(rk)
                self._sel.register(rk.proc.stdout, selectors.EVENT_READ, rk)
        except BaseException:
            self.close(kill=True)
            raise

    @property
    def pids(self) -> list[int]:
        return [rk.proc.pid for rk in self.ranks]

    def log_tail(self, n: int = 3000) -> str:
        parts = []
        for rk in self.ranks:
            try:
                data = rk.log_path.read_bytes()[-max(n // self.world_size, 200):]
            except OSError:
                data = b""
            parts.append(f"--- rank {rk.rank} log ---\n{data.decode(errors='replace')}")
        return "\n".join(parts)

    def request(self, obj: dict, timeout: float) -> dict:
        """Send ``obj`` to every rank; wait for each rank's answer, allowing ``timeout`` seconds between
        two reports of one rank.  Returns rank 0's answer (or the first failing rank's) with
        ``"ranks": [{"rank", "ok", "result", "steps": [digests per step], "error"}, ...]``."""
        for rk in self.ranks:
            rk.send(obj)
        now = time.monotonic()
        last = {rk.rank: now for rk in self.ranks}
        final: dict[int, dict] = {}
        steps: dict[int, list[dict]] = {rk.rank: [] for rk in self.ranks}
        while len(final) < len(self.ranks):
            now = time.monotonic()
            late = [rk for rk in self.ranks if rk.rank not in final and now - last[rk.rank] > timeout]
            if late:
                raise RankTimeout(self._hang_message(late, final, steps, timeout))
            wait = min(timeout - (now - last[rk.rank]) for rk in self.ranks if rk.rank not in final)
            for key, _ in self._sel.select(max(wait, 0.01)):
                rk: _Rank = key.data
                chunk = os.read(rk.proc.stdout.fileno(), 1 << 20)
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
                        steps[rk.rank].append(msg.get("digests", {}))
                    else:
                        final[rk.rank] = msg
        ranks = [{"rank": r, "ok": final[r].get("ok"), "result": final[r].get("result"), "steps": steps[r],
                  "error": final[r].get("error")} for r in sorted(final)]
        bad = [final[r] for r in sorted(final) if not final[r].get("ok")]
        resp = dict(bad[0] if bad else final[0])
        resp["ranks"] = ranks
        syncs = [final[r].get("sync") for r in sorted(final)]
        if obj.get("op") == "run" and (bad or any(s != syncs[0] for s in syncs[1:])):
            resp["desync"] = "; ".join(f"rank {r}: {final[r].get('sync')}" for r in sorted(final)) if not bad else \
                "a rank failed"
        return resp

    def _hang_message(self, late: list[_Rank], final: dict, steps: dict, timeout: float) -> str:
        who = ", ".join(f"rank {rk.rank} (after {len(steps[rk.rank])} train step(s))" for rk in late)
        done = ", ".join(f"rank {r}" for r in sorted(final)) or "none"
        parts = [f"no report within {timeout:.0f} s from {who}; finished: {done}"]
        starts = [rk.signal_stacks() for rk in late]
        time.sleep(1.0)  # faulthandler writes from the signal handler, even inside a blocked collective
        for rk, start in zip(late, starts):
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
        try:
            self._sel.close()
        except Exception:
            pass
        self.ranks = []
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


# ------------------------------------------------------------------ cross-rank checks
def per_step(events: list[dict]) -> list[dict[str, list]]:
    """Each train step's module trace and parameter order (the events up to and including its STEP)."""
    out: list[dict[str, list]] = [{"modules": [], "params": []}]
    for e in events:
        k = e.get("kind")
        if k in MODULE_KINDS:
            out[-1]["modules"].append(f"{k} {e.get('module')} {e.get('phase') or ''}".strip())
        elif k in PARAM_KINDS:
            out[-1]["params"].append(f"{k} {e.get('param')}")
        elif k == "step":
            out.append({"modules": [], "params": []})
    return out


def _first_diff(a: list, b: list) -> tuple[int, Any, Any] | None:
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else "(nothing)"
        y = b[i] if i < len(b) else "(nothing)"
        if x != y:
            return i, x, y
    return None


def cross_rank_problems(ranks: list[dict]) -> dict[str, str]:
    """Cross-rank check id -> what differs, comparing every rank with rank 0."""
    out: dict[str, str] = {}
    r0 = ranks[0]
    res0 = r0.get("result") or {}
    for rk in ranks[1:]:
        res = rk.get("result") or {}
        r = rk["rank"]
        e0 = (res0.get("error_check"), res0.get("origin")) if res0.get("error") else None
        e1 = (res.get("error_check"), res.get("origin")) if res.get("error") else None
        if e0 != e1 and "ranks-outcome" not in out:
            say = lambda e, x: (f"raised {x.get('error', '').splitlines()[0][:200]}" if e else  # noqa: E731
                                f"finished {x.get('steps', 0)} train step(s)")
            out["ranks-outcome"] = f"rank 0 {say(e0, res0)}; rank {r} {say(e1, res)}"
        if "ranks-trace" not in out:
            s0, s1 = per_step(res0.get("events") or []), per_step(res.get("events") or [])
            for i in range(min(len(s0), len(s1))):
                for what, label in (("modules", "module trace"), ("params", "parameter order")):
                    d = _first_diff(s0[i][what], s1[i][what])
                    if d is not None and "ranks-trace" not in out:
                        out["ranks-trace"] = (f"train step {i}: the {label} differs at position {d[0]}: rank 0 "
                                              f"saw {d[1]!r}, rank {r} saw {d[2]!r}")
        if "ranks-params" not in out:
            for i, (d0, d1) in enumerate(zip(r0.get("steps") or [], rk.get("steps") or [])):
                bad = [n for n in d0 if d0.get(n) != d1.get(n)] + [n for n in d1 if n not in d0]
                if bad:
                    out["ranks-params"] = (f"after train step {i}: the gathered parameters differ between rank 0 "
                                           f"and rank {r}: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
                    break
        if res.get("mismatch") and not res0.get("mismatch") and "oracle" not in out:
            out["oracle"] = f"rank {r}: {res['mismatch']}"
    return out


def _device_for(world_size: int) -> str:
    """``cuda`` (nccl, one GPU per rank) when there are at least ``world_size`` GPUs, else ``cpu`` (gloo)."""
    try:
        import torch
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"
    except Exception:  # pragma: no cover
        return "cpu"


class DeepSpeedRanksTarget(DeepSpeedTarget):
    """`DeepSpeedTarget` on a `RankPool` of ``world_size`` ranks; adds the cross-rank checks.
    ``timeout`` is per train step and rank (default 60 s, ``$ZEROSTATE_EXAMPLE_TIMEOUT``)."""

    def __init__(self, *, world_size: int = 2, **kw: Any):
        if world_size < 2:
            raise TargetError(f"DeepSpeedRanksTarget needs world size 2 or more (asked for {world_size})")
        self.world_size = world_size
        self._last: dict | None = None
        self.stall: dict | None = None  # tests: {"rank": r, "seconds": s} simulates a rank that never arrives
        self.desync_restarts = 0
        self.unmatched: int | None = None  # tests: this rank issues one extra collective after the run
        super().__init__(**kw)

    def _start(self) -> dict:
        if "ZEROSTATE_RANKS_DEVICE" not in self._env:
            self._env["ZEROSTATE_RANKS_DEVICE"] = _device_for(self.world_size)
            if self._env["ZEROSTATE_RANKS_DEVICE"] == "cpu":
                self._env["CUDA_VISIBLE_DEVICES"] = ""  # fewer GPUs than ranks: gloo on CPU
        self.worker = RankPool(self._env, self.world_size, self._log_path)
        try:
            hello = self.worker.request({"op": "hello"}, self.startup_timeout)
        except BaseException as exc:
            if not isinstance(exc, (WorkerTimeout, WorkerDied)):  # Ctrl-C during start-up: no rank stays
                self.worker.close(kill=True)
                self.worker = None
                raise
            tail = self.worker.log_tail()
            self.worker.close(kill=True)
            self.worker = None
            raise TargetError(f"the DeepSpeed rank pool ({self.world_size} ranks) did not start ({exc}):\n"
                              f"{tail}") from None
        if not hello.get("ok"):
            self.worker.close(kill=True)
            self.worker = None
            where = f" from {self._extra}" if self._extra else ""
            raise TargetError(f"DeepSpeed{where} does not import or initialise on {self.world_size} ranks: "
                              f"{hello.get('error')}\n{hello.get('traceback', '')}")
        if int(hello.get("world_size", 0)) != self.world_size:
            self.worker.close(kill=True)
            self.worker = None
            raise TargetError(f"the rank pool initialised world size {hello.get('world_size')}, "
                              f"not {self.world_size}")
        return hello

    def raw(self, scenario: Scenario) -> dict:
        if self.worker is None:
            self._start()
        req: dict[str, Any] = {"op": "run", "scenario": scenario.to_dict()}
        if self.stall:
            req["stall"] = self.stall
        if self.unmatched is not None:
            req["unmatched"] = self.unmatched
        resp = self.worker.request(req, self.timeout)
        self._last = resp
        return resp

    def run(self, scenario: Scenario) -> Outcome:
        self._last = None
        out = super().run(scenario)
        last = self._last
        if last is not None and last.get("desync"):
            # the ranks issued different numbers of collectives (one raised earlier than the other): the
            # next example would pair collectives wrongly; start from a fresh process group instead
            self._restart()
            self.desync_restarts += 1
            out.details["pool_restarted"] = f"ranks out of step after this example ({last['desync']})"
        if last is not None and last.get("ranks") and not out.details.get("skipped"):
            problems = cross_rank_problems(last["ranks"])
            have = {f.key for f in out.findings}
            for check, text in problems.items():
                if check in have:
                    continue
                out.findings.append(Finding(check, f"DeepSpeed {self.version}, {self.world_size} ranks: {text}",
                                            scenario, list(out.trace), None, self.name, self.version))
            out.details["ranks"] = [{"rank": rk["rank"], "steps": len(rk.get("steps") or []),
                                     "error": (rk.get("result") or {}).get("error") or rk.get("error")}
                                    for rk in last["ranks"]]
        out.details["world_size"] = self.world_size
        for f in out.findings:
            f.world_size = self.world_size  # read by repro.repro_script (torchrun / deepspeed launcher lines)
        return out


__all__ = ["CROSS_CHECKS", "DeepSpeedRanksTarget", "RankPool", "RankTimeout", "cross_rank_problems", "per_step"]
