"""Several ranks: real DeepSpeed on a real torch.distributed process group, checked across ranks.

::

    t = get_target("deepspeed", deepspeed="0.19.2", world_size=2)   # a DeepSpeedRanksTarget
    outcome = t.run(scenario); t.close()

`DeepSpeedRanksTarget` (this file) is `DeepSpeedTarget` on a rank pool: `rank_pool.RankPool` starts
``world_size`` rank processes (`rank_worker`) once per target, with one rendezvous that lives as long
as the pool (gloo on CPU, nccl on GPUs).  Every example sends the *same* scenario to every rank; the
ranks run it in lockstep (their collectives tie them together), each on its equal share of the global
batch (`net.rank_rows`), and each reports the checksums of the gathered parameters after every train
step, then its trace and result.  The parent (Hypothesis drives it, as at world size 1) compares
(`cross_rank_checks`):

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
(``desync_restarts``; ``Outcome.pool_restarted``).  Ranks that both raise at the same point stay in
step and keep the pool.

Hangs: a rank that sends nothing for ``timeout`` seconds (per train step) is a ``hang`` finding, with
the stacks of the stuck ranks; the pool is killed and restarted (`rank_pool` says how no rank
outlives the run).
"""

from __future__ import annotations

from typing import Any

from zerostate.model.scenario import Scenario

from zerostate.findings.record import RunRecord
from zerostate.targets.interface import Outcome, RankSummary, TargetError

from zerostate.harness import envs
from zerostate.harness.cross_rank_checks import cross_rank_problems, rank_runs
from zerostate.harness.rank_pool import RankPool
from zerostate.harness.worker_process import WorkerDied, WorkerTimeout
from zerostate.harness.protocol import Response, Stall
from zerostate.targets.deepspeed.target import DeepSpeedTarget, StartFailed


def _device_for(world_size: int) -> str:
    """``cuda`` (nccl, one GPU per rank) when there are at least ``world_size`` GPUs, else ``cpu`` (gloo)."""
    import torch
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"


class DeepSpeedRanksTarget(DeepSpeedTarget):
    """`DeepSpeedTarget` on a `RankPool` of ``world_size`` ranks; adds the cross-rank checks.
    ``timeout`` is per train step and rank (default 60 s, ``$ZEROSTATE_EXAMPLE_TIMEOUT``)."""

    def __init__(self, *, world_size: int = 2, **kw: Any) -> None:
        if world_size < 2:
            raise TargetError(f"DeepSpeedRanksTarget needs world size 2 or more (asked for {world_size})")
        self.world_size = world_size
        self._last: Response | None = None
        self.stall: Stall | None = None  # tests: {"rank": r, "seconds": s} simulates a rank that never arrives
        self.desync_restarts = 0
        self.unmatched: int | None = None  # tests: this rank issues one extra collective after the run
        super().__init__(**kw)

    def _start_once(self) -> Response:
        self.worker = pool = self._take_spare() or self._new_worker()
        try:
            hello = self._hello(pool)
        except BaseException as exc:
            if not isinstance(exc, (WorkerTimeout, WorkerDied)):  # Ctrl-C during start-up: no rank stays
                pool.close(kill=True)
                self.worker = None
                raise
            tail = pool.log_tail()
            pool.close(kill=True)
            self.worker = None
            raise StartFailed(f"the DeepSpeed rank pool ({self.world_size} ranks) did not start ({exc}):\n"
                              f"{tail}") from None
        if not hello.get("ok"):
            pool.close(kill=True)
            self.worker = None
            where = f" from {self._extra}" if self._extra else ""
            raise TargetError(f"DeepSpeed{where} does not import or initialise on {self.world_size} ranks: "
                              f"{hello.get('error')}\n{hello.get('traceback', '')}")
        if int(hello.get("world_size", 0)) != self.world_size:
            pool.close(kill=True)
            self.worker = None
            raise TargetError(f"the rank pool initialised world size {hello.get('world_size')}, "
                              f"not {self.world_size}")
        if self._keep_spare and self._spare is None:
            self._spare = self._new_worker()
        self._note_start(hello)
        return hello

    def _new_worker(self) -> RankPool:
        """A rank pool, started now (its ranks rendezvous and import DeepSpeed while the caller goes on); its
        logs are the ones the current pool does not write."""
        if "ZEROSTATE_RANKS_DEVICE" not in self._env:
            self._env["ZEROSTATE_RANKS_DEVICE"] = _device_for(self.world_size)
            if self._env["ZEROSTATE_RANKS_DEVICE"] == "cpu":
                self._env["CUDA_VISIBLE_DEVICES"] = ""  # fewer GPUs than ranks: gloo on CPU
        # in the checkout's root, as the world-size-1 worker: a git checkout's DeepSpeed reads 'version.txt' there
        return RankPool(self._env, self.world_size, self._free_log_path(), envs.worker_cwd(self.path))

    def worker_response(self, scenario: Scenario) -> Response:
        req = self.run_request(scenario)
        if self.stall:
            req["stall"] = self.stall
        if self.unmatched is not None:
            req["unmatched"] = self.unmatched
        resp = self._worker().request(req, self.timeout)
        self._last = resp
        return resp

    def _across_ranks(self, resp: Response, scenario: Scenario) -> dict[str, tuple[str, str]] | None:
        ranks = resp.get("ranks")
        return cross_rank_problems(rank_runs(ranks), scenario) if ranks else None

    def _other_ranks(self, resp: Response) -> list[RunRecord]:
        return [r.record for r in rank_runs((resp.get("ranks") or [])[1:]) if r.record is not None]

    def run(self, scenario: Scenario) -> Outcome:
        self._last = None
        out = super().run(scenario)
        last = self._last
        if last is not None and last.get("desync"):
            # the ranks issued different numbers of collectives (one raised earlier than the other): the
            # next example would pair collectives wrongly; start from a fresh process group instead
            self._restart()
            self.desync_restarts += 1
            out.pool_restarted = "; ".join(filter(None, (out.pool_restarted,
                                                          f"ranks out of step after this example ({last['desync']})")))
        if last is not None and last.get("ranks") and not out.skipped:
            out.ranks = tuple(RankSummary(r.rank, len(r.steps), (r.record.error if r.record else None) or r.error)
                              for r in rank_runs(last["ranks"]))
        out.world_size = self.world_size
        return out


__all__ = ["DeepSpeedRanksTarget"]
