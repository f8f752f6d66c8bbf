"""Watch a user's own DeepSpeed engine: the specs checked online on its real events, as it trains.

Three ways in:

* ``zerostate.watch(engine)`` -> `WatchHandle` (``handle.violations``, ``handle.memory``,
  ``handle.summary()``, ``handle.close()``), for code that builds the engine itself;
* `zerostate.watcher.hf.WatchCallback`, an HF ``TrainerCallback``: every engine ``deepspeed.initialize`` builds from
  then on (the one ``Trainer`` builds) is watched; ``callback.handles``;
* ``enable()``, called by the ``sitecustomize.py`` that ``zerostate watch -- COMMAND`` puts on
  ``PYTHONPATH``: every engine of every rank is watched, settings from the environment
  (``ZEROSTATE_WATCH_DIR``, ``ZEROSTATE_WATCH_STOP``, ``ZEROSTATE_WATCH_RUNTIME``,
  ``ZEROSTATE_WATCH_HANG``).

With a folder, each engine writes ``rank<r>-<pid>-<n>.json`` there (atomically, at each new violation,
each train step and at exit -- so a crash or Ctrl-C keeps every violation seen);
``zerostate watch`` merges them into one report.  A rank that stays inside one engine call (forward,
backward, step) longer than the hang limit gets its Python stack written to ``rank<r>-<pid>.stack``
(``faulthandler``), as the rank pool does for a rank stuck in a collective.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from typing import IO, Any, TypedDict
from collections.abc import Callable

ENV_DIR, ENV_STOP, ENV_RUNTIME, ENV_HANG = ("ZEROSTATE_WATCH_DIR", "ZEROSTATE_WATCH_STOP", "ZEROSTATE_WATCH_RUNTIME",
                                             "ZEROSTATE_WATCH_HANG")
DEFAULT_HANG_S = 300.0

_HANDLES: list[WatchHandle] = []
_ENGINES = [0]
_LOCK = threading.Lock()


class Settings(TypedDict):
    """How every engine of a process is watched (``zerostate watch``'s environment, `patch_initialize`)."""

    out: str | None
    stop_on_violation: bool
    hang_s: float | None
    runtime: bool


class WatchStop(RuntimeError):
    """Raised in the job at the end of the engine call that saw a violation (``stop_on_violation``)."""


def _rank() -> int:
    from zerostate.watcher.process import _rank as rank
    return rank()


class WatchHandle:
    """One watched engine.  ``violations``: list of dicts (spec, message, step, backward, rank, the known issue
    explaining it -- ``known_issue`` / ``explanation``, `zerostate.watcher.judge` --, events around); ``job_crash``: an
    exception the job's own code raised inside an engine call (never labelled); ``memory``: gathered-parameter peak
    per backward, all-gathers per step, one step's series."""

    def __init__(self, engine: Any, out: str | None = None, stop_on_violation: bool = False,
                 hang_s: float | None = None, runtime: bool = False) -> None:
        import deepspeed

        from zerostate.watcher.monitor import OnlineChecker, watch_specs
        from zerostate.watcher.tracer import WatchTracer
        self.engine = engine
        self.rank = _rank()
        from zerostate.watcher.process import world_size
        self.world_size = world_size()
        self.version = deepspeed.__version__
        self.stop_on_violation = stop_on_violation
        self.out = out
        self.runtime = runtime
        with _LOCK:
            _ENGINES[0] += 1
            self.n = _ENGINES[0]
        self.path = os.path.join(out, f"rank{self.rank}-{os.getpid()}-{self.n}.json") if out else None
        self.error: dict[str, Any] | None = None
        self._stop_pending: str | None = None
        self._broken: str | None = None
        """The engine call an exception (or Ctrl-C) escaped from, if one did."""
        self._closed = False
        self.destroyed = False
        """The job called ``engine.destroy()`` (the handle closed there)."""
        self._last_flush = 0.0
        numels = {n: int(getattr(p, "ds_numel", 0) or p.numel()) for n, p in engine.module.named_parameters()}
        self.checker = OnlineChecker(lambda n: numels.get(n, 0), on_violation=self._on_violation)
        self.tracer = WatchTracer(engine, sink=self.checker.feed_many)
        self.shares_with: list[int] = []
        """The live engines (their handles' numbers) wrapping some of the same parameters."""
        for h in list(_HANDLES):
            if not h._closed and h.rank == self.rank and h.tracer.param_names.keys() & self.tracer.param_names.keys():
                h.shares_with.append(self.n)
                self.shares_with.append(h.n)
                h.flush(force=True)
        self.checker.set_specs(watch_specs(self.tracer.params_of, self.tracer.stage))
        self.tracer.on_trace_sync = self._trace_synced
        self._hang = _HangWatch(out, self.rank, hang_s) if out and hang_s else None
        self._wrap_calls()
        self.tracer.install()
        self.started = time.time()
        _HANDLES.append(self)
        self.flush(force=True)

    def _trace_synced(self) -> None:
        self.tracer.deliver()  # the events before the synchronisation are judged from the old state
        self.checker.restart("trace-consistent")

    # ------------------------------------------------------------ what it saw
    @property
    def violations(self) -> list[dict[str, Any]]:
        self.tracer.deliver()  # the events the tracer still holds are checked first
        out = [dict(rec, rank=self.rank) for rec in self.checker.to_dict()]
        if self.error is not None and not self.error.get("job_crash"):
            out.append(dict(self.error, rank=self.rank))
        return out

    @property
    def job_crash(self) -> dict[str, Any] | None:
        """The exception the job's own code raised inside an engine call (its model's forward, say), if one did."""
        return dict(self.error, rank=self.rank) if self.error is not None and self.error.get("job_crash") else None

    @property
    def memory(self) -> dict[str, Any]:
        self.tracer.deliver()
        return self.checker.memory()

    @property
    def events(self) -> int:
        """Events checked so far."""
        self.tracer.deliver()
        return self.checker.events_seen

    @property
    def in_call(self) -> bool:
        """An exception escaped one of this engine's calls (the process's crash, if it crashed, came from there)."""
        return self._broken is not None

    @property
    def steps(self) -> int:
        return self.tracer.steps

    @property
    def backwards(self) -> int:
        return self.tracer.backwards

    def summary(self) -> str:
        n = len(self.violations)
        return f"{n} violation{'s' if n != 1 else ''} in {self.backwards} backwards, {self.steps} steps"

    def judge_exception(self, text: str, frames: list[Any]) -> dict[str, Any]:
        """What the watch makes of an exception raised after this engine's events (`zerostate.watcher.judge`):
        ``job_crash`` when the job's own code raised it, else the finding's key, origin and known issue, from the
        exception's frames and this engine's evidence trace."""
        self.tracer.deliver()
        trace, _ = self.checker.evidence(None)
        return _judge_exception(text, frames, trace, self.tracer.stage, self.version, self.world_size)

    def to_dict(self) -> dict[str, Any]:
        self.tracer.deliver()
        return {"rank": self.rank, "pid": os.getpid(), "engine": self.n, "deepspeed": self.version,
                "world_size": self.world_size,
                "stage": self.tracer.stage, "runtime": self.runtime, "runtime_installed": self._runtime_installed(),
                "steps": self.steps,
                "backwards": self.backwards, "events": self.checker.events_seen, "closed": self._closed,
                "destroyed": self.destroyed, "shares_parameters_with": self.shares_with,
                "broken_in": self._broken,
                "specs": [s.id for s in self.checker.specs], "kinds": sorted(k.value for k in self.checker.kinds),
                "violations": self.violations, "job_crash": self.job_crash, "memory": self.memory,
                "leaf_modules": {k: {"input_requires_grad": v} for k, v in self.tracer.leaf_inputs.items()},
                "checkpointing": {"non_reentrant_recomputes": self.tracer.recomputes_observed,
                                  "reentrant_module_recomputes": self.tracer.recomputes_unobserved,
                                  "steps": {k: list(v) for k, v in self.tracer.recompute_steps.items()}}}

    def _runtime_installed(self) -> bool:
        """The runtime is in this engine (only a process that imported the runtime can have installed it)."""
        install = sys.modules.get("zerostate.runtime.install")
        return install is not None and install.installation(self.engine) is not None

    # ------------------------------------------------------------ writing
    def flush(self, force: bool = False) -> None:
        if not self.path or not self.out:
            return
        now = time.monotonic()
        if not force and now - self._last_flush < 1.0:
            return
        self._last_flush = now
        from zerostate.atomic import replace_file
        try:
            os.makedirs(self.out, exist_ok=True)
            replace_file(self.path, json.dumps(self.to_dict(), indent=1, default=str) + "\n")
        except OSError as exc:  # never break the user's job over the report
            print(f"zerostate watch: cannot write {self.path}: {exc}", file=sys.stderr)

    def _on_violation(self, rec: dict[str, Any]) -> None:
        """A new violation: labelled now, on the evidence of the train step it happened in (and the one before)."""
        from zerostate.watcher import judge
        trace, index = self.checker.evidence(rec["event"])
        try:
            rec.update(judge.judged(judge.violation(rec["spec"], rec["message"], rec["code"], trace, index,
                                                    self.version, self.world_size or 1)))
        except Exception as exc:  # noqa: BLE001 - never break the job over a label; the report says so
            rec.update(known_issue=None, explanation=None,
                       label_error=f"labelling failed: {type(exc).__name__}: {exc}")
        leftovers = {n: m for n, m in self.tracer.backward_leftovers.items() if n in rec["message"]}
        if leftovers:  # the evidence the label rests on
            rec["evidence"] = {"left_by_module_without_post_backward": leftovers}
        if self.stop_on_violation and self._stop_pending is None:
            self._stop_pending = f"{rec['spec']}: {rec['message']}"
        self.flush(force=True)

    def close(self) -> None:
        """Judge the open obligations (end of the run; not after an engine call raised), write the file, take
        the tracer out."""
        if self._closed:
            return
        self.tracer.deliver()
        if self._broken is None:  # an engine call that raised never completed: its obligations are moot
            self.checker.finish()
        self._closed = True
        self.tracer.uninstall()
        self._restore_calls()
        self.flush(force=True)
        if self in _HANDLES:
            _HANDLES.remove(self)

    # ------------------------------------------------------------ engine calls: errors, stop, hangs
    def _wrap_calls(self) -> None:
        self._orig: dict[str, Any] = {}
        for name in ("forward", "backward", "step", "destroy"):
            if not hasattr(self.engine, name):  # destroy: not on every release
                continue
            orig = getattr(self.engine, name)
            own = name in self.engine.__dict__
            self._orig[name] = (orig, own)
            setattr(self.engine, name, self._guard(name, orig) if name != "destroy" else self._on_destroy(orig))

    def _on_destroy(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """``engine.destroy()`` (HF's resume into a fresh engine, accelerate's ``free_memory``) ends this engine's run:
        its obligations are judged and its tracer taken out first, so a later engine's calls into the module
        functions every engine shares are not folded as this engine's."""
        def destroy(*a: Any, **k: Any) -> Any:
            self.destroyed = True
            self.close()
            return orig(*a, **k)
        return destroy

    def _restore_calls(self) -> None:
        for name, (orig, own) in self._orig.items():
            if own:
                setattr(self.engine, name, orig)
            else:
                self.engine.__dict__.pop(name, None)

    def _guard(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            if self._closed:
                return orig(*a, **k)
            if self._hang is not None:
                self._hang.arm(name)
            returned = False
            try:
                r = orig(*a, **k)
                returned = True
            except BaseException as exc:
                self.tracer.deliver()  # every event up to the exception is checked and kept
                self._broken = self._broken or f"engine.{name}"
                if self.error is None and not isinstance(exc, (WatchStop, KeyboardInterrupt)):
                    self._record_error(name, exc)
                self.flush(force=True)
                raise
            finally:
                if self._hang is not None:
                    self._hang.disarm(returned)
            self.tracer.deliver()  # the call's events are checked before it returns (and stops, with stop_on_violation)
            if name == "step":
                self.flush()
            if self._stop_pending is not None:
                msg, self._stop_pending = self._stop_pending, None
                self.flush(force=True)
                raise WatchStop(f"zerostate watch: stopping on the first violation: {msg}")
            return r
        return call

    def _record_error(self, name: str, exc: BaseException) -> None:
        """The exception that escaped ``engine.<name>``: a finding (labelled on its frames and this engine's
        evidence), the job's crash when its own code raised it, or -- torch's ``CheckpointError`` after a
        ``saved-tensor-intact`` violation -- part of that violation (one event, as `findings.decide` judges it)."""
        from zerostate.watcher.process import frames
        text = f"{type(exc).__name__}: {exc}"
        fs = frames(exc.__traceback__)
        if type(exc).__name__ == "CheckpointError":
            for rec in self.checker.violations:
                if rec["spec"] == "saved-tensor-intact":
                    rec["message"] += "\n(torch raised) " + text
                    rec["raised"] = text
                    return
        error = {"spec": "exception", "message": text, "event": None, "step": self.steps,
                 "backward": self.backwards, "count": 1, "in": f"engine.{name}",
                 "traceback": "".join(traceback.format_exc().splitlines(True)[-12:]),
                 "events": [(j, str(e)) for j, e in self.checker.recent][-40:], "modules": [], "params": [],
                 "frames": fs}
        try:
            error.update(self.judge_exception(text, fs))
        except Exception as judging:  # noqa: BLE001 - never break the job over a label; the report says so
            error.update(known_issue=None, explanation=None,
                         label_error=f"labelling failed: {type(judging).__name__}: {judging}")
        self.error = error


class _HangWatch:
    """Dump every thread's stack to ``rank<r>-<pid>.stack`` if one engine call lasts longer than ``seconds``.

    A call that returns normally wipes the file (it was slow, not stuck); one that raises after the dump
    (Ctrl-C on a hung job, a collective's timeout) keeps it, and nothing is armed after that."""

    _file: IO[str] | None = None

    def __init__(self, out: str, rank: int, seconds: float) -> None:
        self.seconds = seconds
        self.kept = False
        self._header = 0
        if _HangWatch._file is None:
            os.makedirs(out, exist_ok=True)
            _HangWatch._file = open(os.path.join(out, f"rank{rank}-{os.getpid()}.stack"), "w")  # noqa: SIM115 - kept open for faulthandler

    @staticmethod
    def _stack_file() -> IO[str]:
        f = _HangWatch._file
        assert f is not None, "opened by the first _HangWatch"
        return f

    def arm(self, what: str) -> None:
        if self.kept:
            return
        f = self._stack_file()
        f.seek(0)
        f.truncate()
        f.write(f"rank {_rank()} pid {os.getpid()}: engine.{what} still running after {self.seconds:g} s\n")
        f.flush()
        self._header = f.tell()
        faulthandler.dump_traceback_later(self.seconds, repeat=False, file=f, exit=False)

    def disarm(self, returned: bool) -> None:
        if self.kept:
            return
        faulthandler.cancel_dump_traceback_later()
        f = self._stack_file()
        dumped = os.fstat(f.fileno()).st_size > self._header
        if dumped and not returned:
            self.kept = True
            return
        f.seek(0)
        f.truncate()
        f.flush()


def watch(engine: Any, out: str | None = None, stop_on_violation: bool = False,
          hang_s: float | None = None) -> WatchHandle:
    """Watch ``engine`` (built by ``deepspeed.initialize``): every hook and coordinator spec checked online.

    ``out``: a folder to write ``rank<r>-...json`` into as it goes (``zerostate watch`` merges them);
    ``stop_on_violation``: raise `WatchStop` at the end of the engine call that saw the first violation;
    ``hang_s``: dump the stack of an engine call that lasts longer (needs ``out``)."""
    return WatchHandle(engine, out=out, stop_on_violation=stop_on_violation, hang_s=hang_s)


def _close_all() -> None:
    for h in list(_HANDLES):
        try:
            h.close()
        except Exception as exc:  # noqa: BLE001 - at exit, say it and keep closing
            print(f"zerostate watch: closing rank {h.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)


atexit.register(_close_all)


# ------------------------------------------------------------------ every engine deepspeed.initialize builds
_PATCHED: dict[str, Any] = {}


def patch_initialize(out: str | None = None, stop_on_violation: bool = False, hang_s: float | None = None,
                     runtime: bool = False, on_handle: Callable[[WatchHandle], None] | None = None) -> None:
    """Wrap ``deepspeed.initialize`` so every engine it returns is watched (after the runtime, with
    ``runtime``, is installed into it: the tracer then observes the runtime's hook state).  A runtime that cannot
    install here (an unsupported release) leaves the job stock and says why in the process record."""
    import deepspeed
    from zerostate.watcher import process
    rec = process.record()
    if runtime:
        from zerostate.runtime.errors import ZerostateInstallError
        from zerostate.runtime.initialize_patch import patch_deepspeed
        try:
            patch_deepspeed()
        except ZerostateInstallError as exc:  # the job runs stock; the report says so
            if rec is None:
                raise
            rec.runtime_error(f"zerostate.runtime not installed: {exc}")
    if "initialize" in _PATCHED:
        _PATCHED["settings"].update(out=out, stop_on_violation=stop_on_violation, hang_s=hang_s, runtime=runtime)
        if on_handle is not None:
            _PATCHED["callbacks"].append(on_handle)
        return
    original = deepspeed.initialize
    settings: Settings = {"out": out, "stop_on_violation": stop_on_violation, "hang_s": hang_s, "runtime": runtime}
    callbacks = [on_handle] if on_handle is not None else []

    def initialize(*a: Any, **k: Any) -> Any:
        result = original(*a, **k)
        engine = result[0] if isinstance(result, tuple) else result
        if getattr(engine, "optimizer", None) is None or not hasattr(engine, "zero_optimization_stage"):
            if rec is not None:
                rec.engine(False, f"{type(engine).__name__} without an optimizer (an inference engine): not watched")
            return result
        try:
            h = WatchHandle(engine, **settings)
        except Exception as exc:  # the watch failed itself: the job goes on unwatched, the report says so loudly
            if rec is None:
                raise
            rec.engine(False)
            rec.watch_error(f"watching {type(engine).__name__} failed: {type(exc).__name__}: {exc}")
            return result
        if rec is not None:
            rec.engine(True)
        for cb in callbacks:
            cb(h)
        return result

    initialize.__wrapped__ = original  # type: ignore[attr-defined]
    deepspeed.initialize = initialize
    _PATCHED.update(initialize=original, settings=settings, callbacks=callbacks)
    if rec is not None:
        rec.deepspeed_imported(deepspeed.__version__)


def unpatch_initialize() -> None:
    if "initialize" in _PATCHED:
        import deepspeed
        deepspeed.initialize = _PATCHED.pop("initialize")
        _PATCHED.clear()


def enable() -> None:
    """Watch every engine this process builds, with the settings ``zerostate watch`` put in the environment; keep
    this process's record (`zerostate.watcher.process`) for the report."""
    from zerostate.watcher import process
    out = os.environ.get(ENV_DIR)
    settings: Settings = {"out": out, "stop_on_violation": os.environ.get(ENV_STOP) == "1",
                          "hang_s": float(os.environ.get(ENV_HANG) or DEFAULT_HANG_S),
                          "runtime": os.environ.get(ENV_RUNTIME) == "1"}
    if out:
        rec = process.start(out, settings["runtime"])
        rec.where = _where
        rec.judge = _judge_crash
    from zerostate.runtime.autoinstall import after_deepspeed_import
    after_deepspeed_import(lambda: patch_initialize(**settings))


def _judge_crash(crash: dict[str, Any]) -> dict[str, Any]:
    """What the watch makes of the exception that ends this process outside an engine call (`process.Crash`): the
    job's crash (its own code raised it; a ``sys.exit`` that handled no exception), or a finding labelled with the
    evidence of the last engine watched here (none: no trace)."""
    from zerostate.watcher import process
    text = crash.get("cause") or f"{crash['type']}: {crash['message']}"
    frames = crash.get("frames") or []
    if crash["type"] == "SystemExit" and not crash.get("cause"):
        return {"job_crash": True, "where": "sys.exit", "known_issue": None, "explanation": None}
    if _HANDLES:
        return _HANDLES[-1].judge_exception(text, frames)
    rec = process.record()
    return _judge_exception(text, frames, (), 0, rec.data["deepspeed"] if rec is not None else None,
                            process.world_size())


def _judge_exception(text: str, frames: list[Any], trace: tuple[Any, ...], stage: int, version: str | None,
                     world_size: int | None) -> dict[str, Any]:
    """``job_crash`` (and where in the job's code) when the job's own code raised ``text``; else the labelled
    finding's fields (`zerostate.watcher.judge.judged`)."""
    from zerostate.watcher import judge
    f = judge.exception(text, frames, trace, stage, version, world_size or 1)
    if judge.raised_by_the_job(frames):
        return {"job_crash": True, "where": judge.where_in_the_job(frames), "origin": f.origin, "known_issue": None,
                "explanation": None}
    return dict(judge.judged(f), job_crash=False)


def _where() -> tuple[int | None, int | None, bool]:
    """(train step, user backward, inside an engine call) of the last engine watched in this process."""
    if not _HANDLES:
        return None, None, False
    h = _HANDLES[-1]
    return h.steps, h.backwards, h.in_call


__all__ = ["WatchHandle", "WatchStop", "enable", "patch_initialize", "unpatch_initialize", "watch"]
