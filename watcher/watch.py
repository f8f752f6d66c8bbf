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
    """One watched engine.  ``violations``: list of dicts (spec, message, step, backward, rank, explanation,
    events around); ``memory``: gathered-parameter peak per backward, all-gathers per step, one step's series."""

    def __init__(self, engine: Any, out: str | None = None, stop_on_violation: bool = False,
                 hang_s: float | None = None, runtime: bool = False) -> None:
        import deepspeed

        from zerostate.watcher.monitor import OnlineChecker, watch_specs
        from zerostate.watcher.tracer import WatchTracer
        self.engine = engine
        self.rank = _rank()
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
        self._last_flush = 0.0
        numels = {n: int(getattr(p, "ds_numel", 0) or p.numel()) for n, p in engine.module.named_parameters()}
        self.checker = OnlineChecker(lambda n: numels.get(n, 0), on_violation=self._on_violation)
        self.tracer = WatchTracer(engine, sink=self.checker.feed_many)
        self.checker.set_specs(watch_specs(self.tracer.params_of, self.tracer.stage))
        self.tracer.on_trace_sync = self._trace_synced
        self._hang = _HangWatch(out, self.rank, hang_s) if out and hang_s else None
        self._wrap_calls()
        self.tracer.install()
        self.checker.context.update(stage=self.tracer.stage, leaves=sorted(self.tracer.leaves))
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
        out = []
        for rec in self.checker.to_dict():
            v = dict(rec, rank=self.rank)
            if "explanation" not in v:
                v["explanation"] = self._explain(v["spec"], v["message"])
            out.append(v)
        if self.error is not None:
            out.append(dict(self.error, rank=self.rank, explanation=self._explain("exception", self.error["message"])))
        return out

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

    def _explain(self, check: str, message: str) -> dict[str, Any] | None:
        """The known issue this violation's own evidence shows (known/watch.py), from what the tracer saw up to now:
        called when the violation is found, so the evidence is that of the backward it happened in."""
        from zerostate.known.watch import explain
        named = [n for n in self.tracer.param_names.values() if n in message.replace(",", " ").split()]
        leftovers = self.tracer.backward_leftovers
        ctx = dict(self.checker.context, error=message,
                   leaf_without_grad=any(not g for g in self.tracer.leaf_inputs.values()),
                   named_leftovers=bool(named) and all(n in leftovers for n in named))
        e = explain(check, self.version, ctx)
        return e.to_dict() if e is not None else None

    def to_dict(self) -> dict[str, Any]:
        self.tracer.deliver()
        return {"rank": self.rank, "pid": os.getpid(), "engine": self.n, "deepspeed": self.version,
                "stage": self.tracer.stage, "runtime": self.runtime, "runtime_installed": self._runtime_installed(),
                "steps": self.steps,
                "backwards": self.backwards, "events": self.checker.events_seen, "closed": self._closed,
                "broken_in": self._broken,
                "violations": self.violations, "memory": self.memory,
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
        rec["explanation"] = self._explain(rec["spec"], rec["message"])
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
        for name in ("forward", "backward", "step"):
            orig = getattr(self.engine, name)
            own = name in self.engine.__dict__
            self._orig[name] = (orig, own)
            setattr(self.engine, name, self._guard(name, orig))

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
                    self.error = {"spec": "exception", "message": f"{type(exc).__name__}: {exc}",
                                  "event": None, "step": self.steps, "backward": self.backwards, "count": 1,
                                  "in": f"engine.{name}",
                                  "traceback": "".join(traceback.format_exc().splitlines(True)[-12:]),
                                  "events": [(j, str(e)) for j, e in self.checker.recent][-40:],
                                  "modules": [], "params": []}
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
        process.start(out, settings["runtime"]).where = _where
    from zerostate.runtime.autoinstall import after_deepspeed_import
    after_deepspeed_import(lambda: patch_initialize(**settings))


def _where() -> tuple[int | None, int | None, bool]:
    """(train step, user backward, inside an engine call) of the last engine watched in this process."""
    if not _HANDLES:
        return None, None, False
    h = _HANDLES[-1]
    return h.steps, h.backwards, h.in_call


__all__ = ["WatchHandle", "WatchStop", "enable", "patch_initialize", "unpatch_initialize", "watch"]
