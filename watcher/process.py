"""What one watched process did, so that ``zerostate watch`` never reports a silent clean.

Each Python process the command starts (under ``zerostate watch``) writes ``proc-<pid>.json`` beside the
per-engine files: whether it imported deepspeed, how many engines ``deepspeed.initialize`` built and how many
were watched (and why one was not), why ``--runtime`` could not install, a failure of the watch itself, and
an exception that ended the process (with the rank and the train step it was in), and a non-zero
``sys.exit`` with the exception being handled when it was called (a script that catches an error, logs it
and exits 1 never reaches ``sys.excepthook``).  The report reads them
to name the cause when no engine was watched, and to put a crash outside DeepSpeed's engine calls in the
report.  Written atomically when something changes and at exit; a process killed before its exit keeps
what it last wrote.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any, NoReturn, TypedDict
from collections.abc import Callable


class FrameDict(TypedDict):
    """One frame of an exception's traceback (`zerostate.findings.record.Frame` as a dict): ``package`` is the
    top-level name of the module its code was imported as (``deepspeed``, ``torch``, ``transformers``, ``peft``,
    ``zerostate``; ``other``: the job's own code)."""

    package: str
    file: str
    function: str
    line: int
    module: str


class Crash(TypedDict, total=False):
    """An exception that ended the process (``sys.excepthook``)."""

    type: str
    message: str
    traceback: str
    rank: int
    step: int | None
    backward: int | None
    in_engine_call: bool
    """It escaped a watched engine call (then the engine's file holds it as an ``exception`` finding too)."""
    time: float
    """When (``time.time()``): a launcher dies of its rank's death after it."""
    frames: list[FrameDict]
    """The frames of the exception (for ``sys.exit``: of the exception it was handling, else none), outermost
    first: what decides whether the job's own code raised it (`zerostate.watcher.judge.raised_by_the_job`)."""
    judged: dict[str, Any]
    """What `zerostate.watcher.judge` made of it in the process (``job_crash``, the known issue, ...), with the
    evidence trace of the process's last watched engine; absent when judging failed (the report judges it then,
    without a trace)."""


class ProcessFile(TypedDict):
    """``proc-<pid>.json``: crosses from the job's processes to ``zerostate watch``."""

    pid: int
    rank: int | None
    rank_known: bool
    """Its rank was set (``RANK``, or torch.distributed initialised): it is a rank of the job, not a launcher."""
    world_size: int | None
    """The job's world size as this process saw it (torch.distributed's, else ``WORLD_SIZE``; None: neither)."""
    argv: list[str]
    deepspeed: str | None
    initialize_patched: bool
    engines_built: int
    engines_watched: int
    skipped: list[str]
    runtime_requested: bool
    runtime_errors: list[str]
    watch_errors: list[str]
    crash: Crash | None
    exit: Crash | None
    """The last ``sys.exit`` with a non-zero status: a crash only if the command failed (it may have been caught)."""
    ended: bool


class _RuntimeLog(logging.Handler):
    """Keeps the ``zerostate.runtime`` logger's warnings: why the runtime left an engine stock."""

    def __init__(self, record: ProcessRecord) -> None:
        super().__init__(logging.WARNING)
        self.record = record

    def emit(self, rec: logging.LogRecord) -> None:
        self.record.runtime_error(rec.getMessage())


class ProcessRecord:
    """This process's ``proc-<pid>.json`` in ``out`` (``zerostate watch``'s ranks folder)."""

    def __init__(self, out: str, runtime: bool) -> None:
        self.path = os.path.join(out, f"proc-{os.getpid()}.json")
        self.out = out
        self._lock = threading.Lock()
        self.data: ProcessFile = {
            "pid": os.getpid(), "rank": None, "rank_known": False, "world_size": None,
            "argv": [str(a) for a in sys.argv[:8]], "deepspeed": None,
            "initialize_patched": False, "engines_built": 0, "engines_watched": 0, "skipped": [],
            "runtime_requested": runtime, "runtime_errors": [], "watch_errors": [], "crash": None, "exit": None,
            "ended": False}
        self.where: Callable[[], tuple[int | None, int | None, bool]] = lambda: (None, None, False)
        """(train step, user backward, whether an engine call was running) of the watched engine, for a crash."""
        self.judge: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        """What the watch makes of a crash (a `Crash` and ``cause``, the exception a ``sys.exit`` handled):
        `zerostate.watcher.watch` labels it with its last engine's evidence."""
        if runtime:
            logging.getLogger("zerostate.runtime").addHandler(_RuntimeLog(self))

    def deepspeed_imported(self, version: str) -> None:
        self.data["deepspeed"] = version
        self.data["initialize_patched"] = True
        self.write()

    def engine(self, watched: bool, why_not: str = "") -> None:
        self.data["engines_built"] += 1
        if watched:
            self.data["engines_watched"] += 1
        elif why_not:
            self.data["skipped"].append(why_not)
        self.write()

    def runtime_error(self, message: str) -> None:
        if message not in self.data["runtime_errors"]:
            self.data["runtime_errors"].append(message)
            self.write()

    def watch_error(self, message: str) -> None:
        self.data["watch_errors"].append(message)
        self.write()

    def crashed(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        self.data["crash"] = self._crash(exc_type.__name__, str(exc),
                                         "".join(traceback.format_exception(exc_type, exc, tb)[-12:]), frames(tb))
        self.write()

    def exiting(self, status: object) -> None:
        """``sys.exit(status)`` with a non-zero status: the exception being handled, if any, is the cause (its frames
        are the crash's; a ``sys.exit`` handling nothing is the job's own exit: no frames)."""
        _, cause, _ = sys.exc_info()
        where = "".join(traceback.format_stack(limit=8)[:-2])
        if cause is not None:
            message = f"{status!r}, handling {type(cause).__name__}: {cause}"
            text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)[-12:]) + where
            fs = frames(cause.__traceback__)
        else:
            message, text, fs = repr(status), where, []
        self.data["exit"] = self._crash("SystemExit", message, text, fs,
                                        f"{type(cause).__name__}: {cause}" if cause is not None else None)
        self.write()

    def _crash(self, kind: str, message: str, text: str, fs: list[FrameDict], cause: str | None = None) -> Crash:
        step, backward, in_call = self.where()
        crash: Crash = {"type": kind, "message": message[:2000], "traceback": text[-4000:], "rank": _rank(),
                        "step": step, "backward": backward, "in_engine_call": in_call, "time": time.time(),
                        "frames": fs}
        if self.judge is not None and not in_call:  # inside an engine call the engine's record judges it
            try:
                crash["judged"] = self.judge(dict(crash, cause=cause))
            except Exception as exc:  # noqa: BLE001 - never break the job's own exit; the report judges it then
                self.data["watch_errors"].append(f"judging the crash failed: {type(exc).__name__}: {exc}")
        return crash

    def ended(self) -> None:
        self.data["ended"] = True
        self.write()

    def write(self) -> None:
        from zerostate.atomic import replace_file
        self.data["rank"] = _rank()
        self.data["rank_known"] = _rank_known()
        self.data["world_size"] = world_size()
        with self._lock:
            try:
                os.makedirs(self.out, exist_ok=True)
                replace_file(self.path, json.dumps(self.data) + "\n")
            except OSError as exc:  # never break the user's job over the report; say so
                print(f"zerostate watch: cannot write {self.path}: {exc}", file=sys.stderr)


def _rank() -> int:
    """This process's rank: torch.distributed's when it is initialised, else ``RANK`` (0 when unset)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0") or 0)


def _dist() -> Any:
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _rank_known() -> bool:
    return _dist() is not None or bool(os.environ.get("RANK"))


def world_size() -> int | None:
    """The job's world size as this process sees it: torch.distributed's when initialised, else ``WORLD_SIZE``."""
    dist = _dist()
    if dist is not None:
        return int(dist.get_world_size())
    try:
        return int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


_PACKAGES = ("deepspeed", "torch", "transformers", "peft", "zerostate")
"""`zerostate.findings.record.PACKAGES` (not imported here: the sitecustomize imports this module)."""


def frames(tb: TracebackType | None, limit: int = 200) -> list[FrameDict]:
    """The frames of a traceback, outermost first (the innermost ``limit``), each placed in the package of the
    module its code was imported as (``frame.f_globals["__name__"]``), ``other`` for the job's own code."""
    out: list[FrameDict] = []
    for frame, line in list(traceback.walk_tb(tb))[-limit:]:
        module = str(frame.f_globals.get("__name__", "") or "")
        top = module.split(".", 1)[0]
        package = top if top in _PACKAGES else "other"
        base = os.path.basename(frame.f_code.co_filename)
        parts = module.split(".")[1:] if package != "other" else []
        file = "/".join([*parts, base] if base == "__init__.py" else [*parts[:-1], base])
        out.append({"package": package, "file": file, "function": frame.f_code.co_name, "line": int(line or 0),
                    "module": module})
    return out


_RECORD: list[ProcessRecord] = []


def record() -> ProcessRecord | None:
    """This process's record (None when it is not under ``zerostate watch``)."""
    return _RECORD[0] if _RECORD else None


def start(out: str, runtime: bool) -> ProcessRecord:
    """Keep this process's record from now on: at exit, and the exception that ends it (``sys.excepthook``)."""
    import atexit

    if _RECORD:
        return _RECORD[0]
    rec = ProcessRecord(out, runtime)
    _RECORD.append(rec)
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            rec.crashed(exc_type, exc, tb)
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    real_exit = sys.exit

    def exit_recorded(status: str | int | None = None) -> NoReturn:
        if status not in (None, 0):
            rec.exiting(status)
        real_exit(status)

    sys.exit = exit_recorded
    atexit.register(rec.ended)
    return rec


def load(ranks_dir: str) -> list[dict[str, Any]]:
    """Every readable ``proc-<pid>.json`` in ``ranks_dir`` (`load_all` says which could not be read)."""
    return load_all(ranks_dir)[0]


def load_all(ranks_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(every ``proc-<pid>.json`` in ``ranks_dir``, each one that could not be read: ``{"file", "why"}``).  The files
    are replaced atomically, so an unreadable one is not one being written: what it held is lost to the report."""
    out, bad = [], []
    for name in sorted(os.listdir(ranks_dir)) if os.path.isdir(ranks_dir) else []:
        if not (name.startswith("proc-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(ranks_dir, name), encoding="utf-8") as fh:
                out.append(json.load(fh))
        except (OSError, ValueError) as exc:
            bad.append({"file": name, "why": f"{type(exc).__name__}: {exc}"})
    return out, bad


__all__ = ["Crash", "FrameDict", "ProcessFile", "ProcessRecord", "frames", "load", "load_all", "record", "start",
           "world_size"]
