"""`DeepSpeedTarget`: real DeepSpeed in a persistent worker process, traced, checked, oracle-compared.

::

    t = DeepSpeedTarget()                         # the installed DeepSpeed
    t = DeepSpeedTarget(deepspeed="0.18.4")       # cached per-release install, own worker
    t = DeepSpeedTarget(deepspeed_path="../DeepSpeed")   # a local checkout (a PR under review)
    outcome = t.run(scenario); t.close()

One worker process (``python -m zerostate.harness.worker``) serves every
example; it is started with ``PYTHONPATH`` = the release and a ``TORCH_EXTENSIONS_DIR`` of that
release and torch version (`zerostate.jit_ops`: releases never load each other's JIT-built ops).
Each example has a timeout (``timeout``, default 60 s,
or ``$ZEROSTATE_EXAMPLE_TIMEOUT``): no answer in time is a ``hang`` finding, and
the worker is killed and restarted; a worker that dies is a ``crash`` finding.

Findings of one run (at most one per check id):

* ``exception`` -- DeepSpeed raised; ``saved-tensor-intact`` when it was torch's CheckpointError;
* ``oracle`` -- parameters after a train step differ from plain PyTorch beyond the tolerance;
* every spec of `zerostate.specs` violated by the real trace (after an exception, only
  violations at an event; end-of-run obligations of a truncated trace are not judged);
* ``model-agreement`` -- the model design for this release predicts different observable
  behaviour (`agreement`); only for runs that finished, and only for scenarios the model represents:
  for one using a training-setup dimension it does not (`Scenario.beyond_model`: bf16, offload,
  parameter groups, retain_graph, the llama family ...) the outcome's ``details["agreement"]`` says
  which, and the specs and the PyTorch oracle judge the run alone.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from zerostate.model.events import Event
from zerostate.model.scenario import Scenario

from zerostate.targets.interface import Outcome, Spent, Startup, Target, TargetError

from zerostate.findings.build import findings_of, unique_by_key
from zerostate.findings.decide import Decision, ModelRun, decide, decide_failure
from zerostate.findings.finding import Finding
from zerostate.findings.record import RunRecord
from zerostate.findings.wire import WireError, from_wire
from zerostate.known.labels import labelled
import zerostate.jit_ops as jit_ops
from zerostate.tracing import compat
from zerostate.harness import envs
from zerostate.harness.worker_process import (Worker, WorkerDied, WorkerLike, WorkerTimeout,
                                              default_timeout as _default_timeout)
from zerostate.harness.protocol import Response, RunRequest


class DeepSpeedTarget(Target):
    name = "deepspeed"
    world_size = 1
    can_refresh = True
    """`fresh` starts a fresh worker process (a fresh rank pool)."""

    def __init__(self, *, deepspeed: str | None = None, deepspeed_path: str | None = None,
                 design: str | None = None, timeout: float | None = None, check_model: bool = True,
                 startup_timeout: float = 900.0, defer_start: bool = False, coverage: bool = False) -> None:
        self.requested = deepspeed
        self.coverage = coverage
        """Ask the worker for each run's arcs of DeepSpeed's ZeRO files (``Outcome.coverage``)."""
        self.path = deepspeed_path
        self._options: dict[str, Any] = {"deepspeed": deepspeed, "deepspeed_path": deepspeed_path, "design": design,
                         "timeout": timeout, "check_model": check_model, "startup_timeout": startup_timeout,
                                         "coverage": coverage}
        # world size -> the rank pool of the scenarios that ask for more ranks than this target has
        self._rank_pools: dict[int, DeepSpeedTarget] = {}
        self._starting: threading.Thread | None = None  # `prestart`'s
        self._start_error: BaseException | None = None
        self.timeout = timeout or _default_timeout()
        self.startup_timeout = startup_timeout
        self.check_model = check_model
        env = envs.without_rendezvous(dict(os.environ))  # the worker's rendezvous is its own
        env.setdefault("OMP_NUM_THREADS", "1")
        env.pop("PYTHONSTARTUP", None)
        extra = None
        if deepspeed:
            try:
                compat.check_version(deepspeed)
                extra = str(envs.ensure_release(deepspeed))
            except (compat.UnsupportedRelease, envs.InstallError) as exc:
                raise TargetError(str(exc)) from None
        elif deepspeed_path:
            p = Path(deepspeed_path).expanduser().resolve()
            if not (p / "deepspeed" / "__init__.py").exists():
                raise TargetError(f"--deepspeed-path {deepspeed_path}: no deepspeed/__init__.py under {p} "
                                  "(give the root of a DeepSpeed checkout)")
            extra = str(p)
        if extra:
            env["PYTHONPATH"] = extra + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env[jit_ops.ENV] = str(jit_ops.folder_for(env))  # this release's and torch's own, whatever the user set
        self._env = env
        self._extra = extra
        key = f"deepspeed-{deepspeed}" if deepspeed else (envs.path_key(deepspeed_path) if deepspeed_path
                                                          else "installed")
        logs = envs.cache_root() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self._log_path = Path(tempfile.mkstemp(prefix=f"worker-{key}-", suffix=".log", dir=logs)[1])
        self._spare_log_path = self._log_path.with_suffix(".spare.log")
        self.worker: WorkerLike | None = None
        self._spare: WorkerLike | None = None
        self._keep_spare = False  # from the first fresh(): a worker started ahead for the next fresh start
        self.examples = 0
        self.restarts = 0
        self.failed_starts: list[str] = []
        """The starts that timed out or died and were tried again (`_start`), each with the ranks' stacks and logs."""
        self._start_note: str | None = None  # a failed start since the last outcome: said on the next one
        self._spent = Spent()
        self.first_start: Startup | None = None
        """The first worker's start-up (a first JIT build of DeepSpeed's ops is in it), for reports."""
        self._sleep = 0.0  # tests: make the worker sleep before each run (a simulated hang)
        self.perturb: tuple[tuple[str, float], ...] = ()
        """Tests: DeepSpeed's update of these parameters is observed multiplied by the factor (an injected error
        on a real run: `executor.Perturbation`); rank pools started from this target get it too."""
        self._pending = (deepspeed_path, extra, design)
        if defer_start:  # `prestart`: the processes start now, from this thread; `_complete_start` waits for them
            self._spare = self._new_worker()
            return
        self._complete_start()

    def _complete_start(self) -> None:
        """Start the worker (the spare a deferred start made) and check what it imported."""
        deepspeed_path, extra, design = self._pending
        self.hello = self._start()
        version = str(self.hello.get("deepspeed")).strip()
        self.version: str | None = version
        if deepspeed_path and version.startswith("0.0.0"):
            self.close()
            raise TargetError(f"--deepspeed-path {deepspeed_path}: the checkout reports DeepSpeed "
                              f"{version} and has no readable version.txt at its root (a plain git "
                              "checkout reads its version from there; see envs.checkout_version)")
        try:
            compat.check_version(version)
        except compat.UnsupportedRelease as exc:
            self.close()
            raise TargetError(str(exc)) from None
        if extra and not os.path.realpath(self.hello["file"]).startswith(os.path.realpath(extra)):
            self.close()
            raise TargetError(f"the worker imported DeepSpeed from {self.hello['file']}, not from {extra}")
        from zerostate.model.designs import design_for_release, get_design
        self.design = get_design(design) if design else design_for_release(version)

    # ------------------------------------------------------------ worker life
    def _new_worker(self) -> WorkerLike:
        """A worker process, started now; it imports DeepSpeed and initialises while the caller goes on.
        Its log is the one of the two log files the current worker does not write."""
        return Worker(self._env, self._free_log_path(), envs.worker_cwd(self.path))

    def _free_log_path(self) -> Path:
        """The one of the two log files (main, spare) the current worker does not write."""
        busy = self.worker.log_path if self.worker is not None else None
        return self._spare_log_path if busy == self._log_path else self._log_path

    def _take_spare(self) -> WorkerLike | None:
        spare, self._spare = self._spare, None
        if spare is not None and not spare.alive():  # it died while waiting: start afresh
            spare.close(kill=True)
            spare = None
        return spare

    def _start(self) -> Response:
        """Start a worker (the spare, if one waits) and check its hello.  A start that timed out or died is tried
        once more in a fresh process (a start-up stuck in the process group's rendezvous says nothing about
        the scenarios): the failure is kept (``failed_starts``), counted in ``restarts`` and said on the
        next outcome (``Outcome.pool_restarted``); a second one raises.  A worker that answers with an error
        (DeepSpeed does not import or initialise) raises at once: starting it again would show the same."""
        try:
            return self._start_once()
        except StartFailed as exc:
            first = str(exc).splitlines()[0]
            self.failed_starts.append(str(exc))
            self.restarts += 1
            self._start_note = f"a worker start failed and a fresh one was started: {first}"
        return self._start_once()

    def _start_once(self) -> Response:
        self.worker = worker = self._take_spare() or self._new_worker()
        try:
            hello = self._hello(worker)
        except (WorkerTimeout, WorkerDied) as exc:
            tail = worker.log_tail()
            worker.close(kill=True)
            self.worker = None
            raise StartFailed(f"the DeepSpeed worker did not start ({exc}):\n{tail}") from None
        if not hello.get("ok"):
            worker.close(kill=True)
            self.worker = None
            where = f" from {self._extra}" if self._extra else ""
            raise TargetError(f"DeepSpeed{where} does not import or initialise: {hello.get('error')}\n"
                              f"{hello.get('traceback', '')}")
        if self._keep_spare and self._spare is None:
            self._spare = self._new_worker()
        self._note_start(hello)
        return hello

    def _hello(self, worker: WorkerLike) -> Response:
        """The started ``worker``'s hello (raises WorkerTimeout / WorkerDied), counted in `spent`."""
        t0 = time.perf_counter()
        try:
            hello = worker.request({"op": "hello"}, self.startup_timeout)
        finally:
            self._spent += Spent(starts=1, start_waited=time.perf_counter() - t0)
        self._spent += Spent(start_seconds=float(hello.get("startup_seconds") or 0.0), forked_starts=int(worker.forked))
        return hello

    def spent(self) -> Spent:
        """Where this target's time went (its rank pools' included)."""
        total = self._spent
        for pool in self._rank_pools.values():
            total += pool.spent()
        return total

    def _note_start(self, hello: Response) -> None:
        if self.first_start is None:  # a forked worker's includes its server's imports and warm-up
            seconds = float(hello.get("startup_seconds") or 0.0) + float(hello.get("server_startup_seconds") or 0.0)
            self.first_start = {"world_size": self.world_size, "seconds": round(seconds, 3),
                                "jit_builds": list(hello.get("jit_builds") or [])}

    def startup(self) -> list[Startup]:
        """What starting this target's workers cost, per world size: seconds from the process's start to its
        answer, and the ops DeepSpeed JIT-built meanwhile (a first build: minutes).  Reported as start-up."""
        own = [self.first_start] if self.first_start is not None else []
        return own + [s for ws in sorted(self._rank_pools) for s in self._rank_pools[ws].startup()]

    def _restart(self) -> None:
        if self.worker is not None:
            self.worker.close(kill=True)
        self.restarts += 1
        self._start()

    def fresh(self) -> None:
        """A fresh worker (a fresh rank pool at world size 2) for the next run, nothing carried over from
        the runs before: the explorer confirms each finding in one (`explorer.confirm`).  Not
        counted in ``restarts`` (those are the restarts a hang, a crash or ranks out of step forced).

        From the first call on, one more worker is kept started ahead (a *spare*: a new process that has
        imported DeepSpeed and run nothing), so the next fresh start costs no start-up.  A spare is a fresh
        worker like any other: nothing has run in it."""
        self._keep_spare = True
        self._settle()
        for pool in self._rank_pools.values():  # stopped now, started again (from its spare) when next used
            pool._keep_spare = True
            pool._drop_worker()
        if self.worker is not None:
            self.worker.close(kill=True)
            self.worker = None
        self._start()

    def _drop_worker(self) -> None:
        if self.worker is not None:
            self.worker.close(kill=True)
            self.worker = None

    def prestart(self, world_size: int = 2) -> None:
        """Start the rank pool of ``world_size``-rank scenarios now, in a background thread, so the first such
        scenario does not wait for its start-up (seconds).  `cli.cmd_explore` calls it: the default strategy
        draws world size 2 (`strategies.WORLD2_RATE`).  A failed start is raised by the first scenario that
        needs the pool, as if it had started the pool itself."""
        self._settle()
        if world_size <= self.world_size or world_size in self._rank_pools:
            return
        from zerostate.targets.deepspeed.ranks import DeepSpeedRanksTarget
        try:  # its processes are started here, in this thread: a rank dies with the thread that started it
            pool = DeepSpeedRanksTarget(world_size=world_size, defer_start=True, **self._options)  # (PDEATHSIG)
        except TargetError as exc:
            self._start_error = exc
            return

        def start() -> None:  # only waits for the ranks to answer, and checks them
            try:
                pool._complete_start()
                self._rank_pools[world_size] = pool
            except BaseException as exc:  # noqa: BLE001 -- handed to the scenario that needs the pool
                pool.close()
                self._start_error = exc

        self._starting = threading.Thread(target=start, name=f"prestart-ws{world_size}", daemon=True)
        self._starting.start()

    def wait_prestarted(self) -> None:
        """Wait until `prestart`'s rank pools have started (or failed to: the first scenario that needs one
        raises its error).  The benchmark times examples after it, so a pool's start-up counts as start-up."""
        self._settle()

    def _settle(self) -> None:
        """Wait for `prestart`'s thread, if one runs."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None

    def _close_rank_pools(self) -> None:
        self._settle()
        while self._rank_pools:
            self._rank_pools.popitem()[1].close()

    def _target_for(self, scenario: Scenario) -> DeepSpeedTarget:
        """This target, or -- for a scenario that asks for more ranks than it has (``world_size``) -- a
        rank-pool target of that size, built like this one and started on first use (`ranks`)."""
        ws = scenario.world_size
        if ws <= self.world_size:
            return self
        self._settle()
        if self._start_error is not None:
            exc, self._start_error = self._start_error, None
            raise exc
        if ws not in self._rank_pools:
            from zerostate.targets.deepspeed.ranks import DeepSpeedRanksTarget
            self._rank_pools[ws] = DeepSpeedRanksTarget(world_size=ws, **self._options)
        self._rank_pools[ws].perturb = self.perturb
        return self._rank_pools[ws]

    def close(self) -> None:
        self._close_rank_pools()
        self._keep_spare = False
        if self._spare is not None:
            self._spare.close(kill=True)
            self._spare = None
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        for log in (self._log_path, self._spare_log_path):  # the logs only matter while a worker runs
            try:  # (errors quote their tail)
                log.unlink()
            except OSError:
                pass

    def __enter__(self) -> DeepSpeedTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ running
    def _worker(self) -> WorkerLike:
        """The running worker, started if there is none."""
        if self.worker is None:
            self._start()
        assert self.worker is not None
        return self.worker

    def measure_coverage(self, on: bool) -> None:
        """From the next run on, ask (or stop asking) every worker of this target, rank pools included, for
        the arcs each run executes (`harness.coverage_probe`; its cost per run is in
        docs/benchmarks-coverage.md)."""
        self._settle()
        self.coverage = on
        self._options["coverage"] = on
        for pool in self._rank_pools.values():
            pool.measure_coverage(on)

    def run_request(self, scenario: Scenario) -> RunRequest:
        req: RunRequest = {"op": "run", "scenario": scenario.to_dict()}
        if self.perturb:
            req["perturb"] = [(n, f) for n, f in self.perturb]
        if self.coverage:
            req["coverage"] = True
        return req

    def worker_response(self, scenario: Scenario) -> Response:
        """The worker's answer for one scenario, not judged yet (`run` judges it; raises WorkerTimeout / WorkerDied)."""
        req = self.run_request(scenario)
        if self._sleep:
            req["sleep"] = self._sleep
        return self._worker().request(req, self.timeout)

    def run(self, scenario: Scenario) -> Outcome:
        out = self._run(scenario)
        if scenario.world_size <= self.world_size:  # a rank pool's run is in the pool's own account
            self._spent += Spent(runs=1, run_seconds=out.seconds, worker_seconds=out.worker_seconds or 0.0,
                                 cpu_seconds=out.cpu_seconds or 0.0, oracle_seconds=out.oracle_seconds or 0.0,
                                 judge_seconds=out.judge_seconds)
        note, self._start_note = self._start_note, None
        if note is not None and out.pool_restarted is None:
            out.pool_restarted = note
        return out

    def _run(self, scenario: Scenario) -> Outcome:
        t0 = time.perf_counter()
        self.examples += 1
        pool = self._target_for(scenario)
        if pool is not self:  # its restarts are this target's (the explorer reads them)
            before = pool.restarts
            try:
                return pool.run(scenario)
            finally:
                self.restarts += pool.restarts - before
        hung: str | None = None
        try:
            resp = self.worker_response(scenario)
        except WorkerTimeout as exc:
            self._restart()
            cause = getattr(exc, "raised", None)
            if cause is None:
                return self._failed(scenario, "hang", f"DeepSpeed {self.version}: {exc} (worker killed and restarted)",
                                    t0)
            # a rank's run raised and the others waited on it in a collective: the finding is that exception
            resp, hung = cause, f"hang after a rank's exception: {str(exc).splitlines()[0]}"
        except WorkerDied as exc:
            tail = self.worker.log_tail(1500) if self.worker else ""
            self._restart()
            return self._failed(scenario, "crash", f"DeepSpeed {self.version}: {exc}\n{tail}", t0)
        out = self._judged(scenario, resp, t0)
        if hung is not None:
            out.pool_restarted = "; ".join(filter(None, (out.pool_restarted, hung)))
        return out

    def _judged(self, scenario: Scenario, resp: Response, t0: float) -> Outcome:
        """The outcome of a worker's answer: its record judged (`decide`) and labelled."""
        if not resp.get("ok"):
            return self._failed(scenario, "internal", f"zerostate's executor failed: {resp.get('error')}\n"
                                f"{resp.get('traceback', '')}", t0)
        try:
            record = from_wire(RunRecord, resp["result"])
        except (WireError, ValueError, TypeError) as exc:  # a worker of another zerostate than this one, a bad line
            return self._failed(scenario, "internal", f"zerostate could not read the worker's record: {exc}", t0)
        if record.skipped:
            return Outcome(scenario, [], None, [], time.perf_counter() - t0, record, resp.get("seconds"),
                           resp.get("cpu_seconds"), resp.get("oracle_seconds"))
        events = list(record.events)
        beyond = scenario.beyond_model()
        model = self._model_run(scenario) if self.check_model and not record.raised and not beyond else None
        others = self._other_ranks(resp)
        t_judge = time.perf_counter()
        decisions = decide(record, scenario, model, self._across_ranks(resp, scenario), other_ranks=others)
        found = self._findings(decisions, scenario, events)
        judged = time.perf_counter() - t_judge
        return Outcome(scenario, events, record.error, found, time.perf_counter() - t0, record, resp.get("seconds"),
                       resp.get("cpu_seconds"), resp.get("oracle_seconds"), judged, resp.get("coverage"),
                       "not checked: the model does not represent " + ", ".join(beyond)
                       if beyond and self.check_model else None)

    def _findings(self, decisions: tuple[Decision, ...] | list[Decision], scenario: Scenario,
                  events: list[Event] | None) -> list[Finding]:
        """The findings of ``decisions`` (the decider's output), labelled, one per key."""
        built = findings_of(decisions, scenario, events, self.name, self.version, self.world_size)
        return unique_by_key(labelled(f) for f in built)

    def _failed(self, scenario: Scenario, check: str, text: str, t0: float) -> Outcome:
        """The outcome of a run that returned no result (a hang, a dead worker, the executor's own failure)."""
        found = self._findings([decide_failure(check, text)], scenario, None)
        return Outcome(scenario, [], text, found, time.perf_counter() - t0)

    def _across_ranks(self, resp: Response, scenario: Scenario) -> dict[str, tuple[str, str]] | None:
        """The cross-rank checks' problems of a rank pool's answer (None: one rank)."""
        return None

    def _other_ranks(self, resp: Response) -> list[RunRecord]:
        """The records of the ranks but rank 0 in a rank pool's answer (none: one rank)."""
        return []

    def _model_run(self, scenario: Scenario) -> ModelRun:
        from zerostate.model.explore import run as model_run
        try:
            model = model_run(self.design, scenario)
        except Exception as exc:  # noqa: BLE001 # pragma: no cover -- the model design's own bug, reported as such
            return ModelRun(self.design.name, error=f"the model design {self.design.name} could not run this "
                                                     f"scenario: {exc}")
        return ModelRun(self.design.name, tuple(model.events))


class StartFailed(TargetError):
    """A worker (a rank pool) timed out or died before it answered its hello (`DeepSpeedTarget._start` tries
    once more)."""


__all__ = ["DeepSpeedTarget", "StartFailed", "Startup", "WorkerDied", "WorkerTimeout"]
