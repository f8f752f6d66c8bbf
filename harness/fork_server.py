"""The fork server: one process that pays a worker's start-up once and forks every worker from it.

A started worker pays seconds of CPU before its first run (torch, DeepSpeed, the dynamo and inductor imports of
DeepSpeed's optimizer check, the tiny Llama warm-up); a forked one pays its own process group.
Started by `forked.ForkServer` as ``python -m zerostate.harness.fork_server FD`` with a worker's
environment, it imports and warms up what a worker would before its process group exists
(`worker_loop.warm_before_fork`), freezes what survives (``gc.freeze``: the children share it copy-on-write),
then serves requests on the ``SOCK_SEQPACKET`` socket ``FD``::

    (server, once ready) -> {"ok": true, "fork": true, "startup_seconds": s, ...}
                            {"ok": true, "fork": false, "why": ...}  (it cannot fork: CUDA, threads)
                            {"ok": false, "error": ...}              (the imports failed)
    {"op": "fork", "module": "worker" | "rank_worker", "env": {...}, "cwd": ..., "session": bool}
        + three file descriptors (the child's stdin, stdout, stderr)  -> {"pid": n}
                                                        or {"stale": why}: a ``deepspeed`` or ``zerostate``
                                                        source file changed since the server imported it; it
                                                        forks no more (its client starts a new one)
    {"op": "status", "pid": n}  -> {"pid": n, "code": c | null}    (null: running, or not reaped yet)

A child is named ``zs-worker`` / ``zs-rank_worker`` (``/proc/PID/comm``). It is as fresh as a started worker: no
process group, no engine (none exists before the fork), its environment and working directory exactly the
request's, its own session when asked (a rank), then the worker's own ``main`` -- which initialises
torch.distributed and answers hello as a started one does. The server exits when the socket closes (its client
is gone); a rank it forked dies with it (the rank's ``PR_SET_PDEATHSIG``), a world-size-1 worker when its stdin
closes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any

MAX_MESSAGE = 1 << 20
"""The largest request: a worker's environment."""

_SET_BY_IMPORTS: dict[str, str] = {}
"""The variables the server's imports and warm-up added to its environment (torch's, DeepSpeed's defaults)."""

_STARTUP = [0.0]
"""Seconds the server's imports and warm-up took (each child's hello reports them: `worker_loop.start_deepspeed`)."""

_SIGINT_AT_START: list[Any] = [signal.default_int_handler]
"""SIGINT's handler when the server's interpreter started: Python's own, or ignored when its client ignores SIGINT
(a background job's), as a worker started by that client would inherit it."""

_SOURCES: dict[str, tuple[int, int]] = {}
"""The files of every ``deepspeed`` and ``zerostate`` module the server imported: (mtime, size) as imported."""

_CODES: dict[int, int] = {}
"""Exit codes of the children reaped so far (as `subprocess` gives them: negative for a signal)."""


def _reap(_signum: int, _frame: object) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _CODES[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.send(json.dumps(obj).encode())


def _child(sock: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the requested worker, run its ``main``, exit with its code (never returns)."""
    code = 1
    try:
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, _SIGINT_AT_START[0])  # as a started worker would have it (inherited ignored)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        if req.get("session"):
            os.setsid()
        os.environ.clear()
        os.environ.update(_SET_BY_IMPORTS)  # a started worker's imports set these too (each unless already set)
        os.environ.update(req["env"])
        os.environ["ZEROSTATE_PARENT_PID"] = str(os.getppid())  # a rank dies with this server (and it with its client)
        os.environ["ZEROSTATE_FORKED"] = str(_STARTUP[0])  # the hello says what the server's start-up cost
        os.chdir(req["cwd"])
        _reseed()
        module = req["module"]
        sys.argv = [f"zerostate.harness.{module}"]
        _name_process(f"zs-{module}")
        if module == "worker":
            from zerostate.harness import worker as entry
        elif module == "rank_worker":
            from zerostate.harness import rank_worker as entry  # type: ignore[no-redef]
        else:
            raise ValueError(f"no worker program {module!r}")
        code = entry.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 -- said on the child's stderr (the worker's log); the client sees it exit
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _name_process(name: str) -> None:
    """The child's name in ``ps``/``top`` and ``/proc/PID/comm`` (its command line stays the server's)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _reseed() -> None:
    """Python's and numpy's global generators from the OS, as a started process seeds them: forked children
    would otherwise share one sequence (the runs seed torch's themselves)."""
    import random
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _record_sources(since_ns: int) -> None:
    """Note the file of every imported ``deepspeed`` and ``zerostate`` module; one written since ``since_ns``
    (the server's start: it may have changed while being imported) is recorded as changed already."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] in ("deepspeed", "zerostate") and path:
            try:
                st = os.stat(path)
            except OSError:
                continue
            _SOURCES[path] = (st.st_mtime_ns, st.st_size) if st.st_mtime_ns < since_ns else (-1, -1)


def _changed_source() -> str | None:
    """A source file the server imported that is not what it imported any more (a checkout under edit, a fault
    applied to a tree), or None: a worker forked then would run code its own start would not import."""
    for path, seen in _SOURCES.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != seen:
            return path
    return None


def serve(sock: socket.socket) -> int:
    signal.signal(signal.SIGCHLD, _reap)
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 3)
        except ConnectionResetError:
            return 0
        if not data:
            return 0  # the client is gone
        req = json.loads(data)
        if req.get("op") == "fork":
            changed = _changed_source()
            if changed is not None:  # this server's code is not the tree's any more: the client starts a new one
                for fd in fds:  # (this one lives on while its client holds it: its ranks die with it)
                    os.close(fd)
                _send(sock, {"stale": f"{changed} changed since the fork server imported it"})
                continue
            for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
                stream.flush()
            pid = os.fork()
            if pid == 0:
                _child(sock, req, fds)
            for fd in fds:
                os.close(fd)
            _send(sock, {"pid": pid})
        elif req.get("op") == "status":
            _reap(0, None)
            _send(sock, {"pid": req.get("pid"), "code": _CODES.get(int(req.get("pid") or 0))})
        else:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": f"unknown op {req.get('op')!r}"})


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _SIGINT_AT_START[0] = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's: it closes the socket
    os.dup2(2, 1)  # nothing the imports print goes anywhere but the server's log
    sys.stdout = sys.stderr
    t0, started_ns = time.perf_counter(), time.time_ns()
    before = dict(os.environ)
    try:
        from zerostate.harness.worker_loop import warm_before_fork
        hello: dict[str, Any] = dict(warm_before_fork())
        _SET_BY_IMPORTS.update((k, v) for k, v in os.environ.items() if k not in before)
    except BaseException as exc:  # noqa: BLE001 -- the client falls back to starting workers, which say it
        hello = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": "".join(traceback.format_exc().splitlines(True)[-15:])}
    hello["startup_seconds"] = _STARTUP[0] = round(time.perf_counter() - t0, 3)
    _record_sources(started_ns)
    _send(sock, hello)
    if not hello.get("ok") or not hello.get("fork"):
        return 0  # the client starts its workers itself
    return serve(sock)


if __name__ == "__main__":
    sys.exit(main())
