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


class Crash(TypedDict):
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


class ProcessFile(TypedDict):
    """``proc-<pid>.json``: crosses from the job's processes to ``zerostate watch``."""

    pid: int
    rank: int | None
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
            "pid": os.getpid(), "rank": None, "argv": [str(a) for a in sys.argv[:8]], "deepspeed": None,
            "initialize_patched": False, "engines_built": 0, "engines_watched": 0, "skipped": [],
            "runtime_requested": runtime, "runtime_errors": [], "watch_errors": [], "crash": None, "exit": None,
            "ended": False}
        self.where: Callable[[], tuple[int | None, int | None, bool]] = lambda: (None, None, False)
        """(train step, user backward, whether an engine call was running) of the watched engine, for a crash."""
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
                                         "".join(traceback.format_exception(exc_type, exc, tb)[-12:]))
        self.write()

    def exiting(self, status: object) -> None:
        """``sys.exit(status)`` with a non-zero status: the exception being handled, if any, is the cause."""
        _, cause, _ = sys.exc_info()
        where = "".join(traceback.format_stack(limit=8)[:-2])
        if cause is not None:
            message = f"{status!r}, handling {type(cause).__name__}: {cause}"
            text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)[-12:]) + where
        else:
            message, text = repr(status), where
        self.data["exit"] = self._crash("SystemExit", message, text)
        self.write()

    def _crash(self, kind: str, message: str, text: str) -> Crash:
        step, backward, in_call = self.where()
        return {"type": kind, "message": message[:2000], "traceback": text[-4000:], "rank": _rank(), "step": step,
                "backward": backward, "in_engine_call": in_call, "time": time.time()}

    def ended(self) -> None:
        self.data["ended"] = True
        self.write()

    def write(self) -> None:
        from zerostate.atomic import replace_file
        self.data["rank"] = _rank()
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
    """Every ``proc-<pid>.json`` in ``ranks_dir`` (an unreadable one is skipped: the process was writing it)."""
    out = []
    for name in sorted(os.listdir(ranks_dir)) if os.path.isdir(ranks_dir) else []:
        if not (name.startswith("proc-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(ranks_dir, name), encoding="utf-8") as fh:
                out.append(json.load(fh))
        except (OSError, ValueError):
            continue
    return out


__all__ = ["Crash", "ProcessFile", "ProcessRecord", "load", "record", "start"]
