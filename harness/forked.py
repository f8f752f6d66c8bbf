"""Worker processes forked from a warm `fork_server` (or started, where none can serve): `start_child`.

`start_child` gives a `Child`: the worker's pipes at once, its process a moment later -- forked by the
fork server of its environment when one serves (one per environment and working directory in this
process: `server_for`), else started as ``python -m zerostate.harness.<module>`` as before.  The server's
first start is paid once, in the background: the first child waits for it (its hello answers when it is
up), the later ones are forked in milliseconds.  ``ZEROSTATE_FORK_SERVER=0`` (``--no-fork-server``)
starts every worker itself.  A server that cannot fork (CUDA, a thread running, its imports failed) says
why in `ForkServer.why` and every child of its environment is started instead: a worker that cannot import
DeepSpeed says so in its own hello, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

ENV = "ZEROSTATE_FORK_SERVER"
"""``0``: no fork server; every worker is a started process."""

PER_PROCESS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE",
               "ZEROSTATE_PARENT_PID", "ZEROSTATE_STACKS")
"""The variables that differ between the ranks of one pool (its rank, its rendezvous, its stacks file): workers
that differ only in these share a server, whose imports do not see them (no supported release reads them at
import).  Any other variable may be read at import, so another value is another server: ``WORLD_SIZE`` too,
which the server of a pool's ranks imports with."""

MAX_IDLE_SERVERS = 2
"""Servers kept in this process beyond the busy ones (each holds torch, DeepSpeed and transformers in memory): a new
server first stops the least recently used servers none of whose children still runs (a rank dies with its
server)."""

SERVER_START_TIMEOUT = 900.0
"""Seconds a child waits for its server's first answer before it is started instead (a first JIT build of
DeepSpeed's ops may run meanwhile)."""


def enabled(env: dict[str, str] | None = None) -> bool:
    return (env if env is not None else os.environ).get(ENV, "1") != "0"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """No fork server for the workers started inside (``--no-fork-server``): `ENV` is ``0`` in this process's
    environment, which every target copies, and as it was after."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


class Stale(OSError):
    """The server's sources changed since it imported them (it forks no more): fork from a new one."""


class ForkServer:
    """One `fork_server` process and its socket; ``ready`` once its hello is read (``fork``: it forks)."""

    def __init__(self, env: dict[str, str], cwd: str, log_path: Path) -> None:
        self.ready = threading.Event()
        self.fork = False
        self.stale = False
        """Its ``deepspeed`` or ``zerostate`` sources changed since it imported them: `server_for` replaces it."""
        self.why = "starting"
        self.hello: dict[str, Any] = {}
        self._lock = threading.Lock()  # one request and its answer at a time
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._log = open(log_path, "ab")  # noqa: SIM115 -- the server's stderr for its life; close() closes it
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "zerostate.harness.fork_server", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=self._log, env=env, cwd=cwd)
        finally:
            theirs.close()
        self.children: list[Child] = []
        """The children launched or waiting to be (those that exited are dropped by `busy`)."""
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        threading.Thread(target=self._launcher, daemon=True, name="fork-server-launcher").start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on this server's launcher thread, once the server answered (in order)."""
        self._jobs.put(job)

    def _launcher(self) -> None:
        """Waits for the server's hello, then launches children, one at a time, for the process's life: a rank
        started here (where the server cannot fork) dies with the thread that started it (``PR_SET_PDEATHSIG``),
        so this thread never ends."""
        self._await_hello()
        while True:
            self._jobs.get()()

    def _await_hello(self) -> None:
        try:
            ready, _, _ = select.select([self._sock], [], [], SERVER_START_TIMEOUT)
            data = self._sock.recv(1 << 20) if ready else b""
            self.hello = json.loads(data) if data else {}
            self.fork = bool(self.hello.get("ok") and self.hello.get("fork"))
            self.why = "" if self.fork else str(self.hello.get("why") or self.hello.get("error")
                                                 or "the fork server gave no answer")
        except (OSError, ValueError) as exc:
            self.why = f"the fork server's answer did not read: {exc}"
        finally:
            if not self.fork:
                self.close()
            self.ready.set()

    def _ask(self, obj: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        with self._lock:
            if fds:
                socket.send_fds(self._sock, [json.dumps(obj).encode()], fds)
            else:
                self._sock.send(json.dumps(obj).encode())
            data = self._sock.recv(1 << 20)
        if not data:
            raise OSError("the fork server is gone")
        answer: dict[str, Any] = json.loads(data)
        return answer

    def fork_child(self, module: str, env: dict[str, str], cwd: str, fds: list[int], session: bool) -> int:
        """Fork a ``module`` worker with ``fds`` as its stdin, stdout and stderr; its pid (raises OSError when the
        server is gone, `Stale` when its sources changed: it exits and is replaced)."""
        answer = self._ask({"op": "fork", "module": module, "env": env, "cwd": cwd, "session": session}, fds)
        if "stale" in answer:
            self.stale, self.why = True, str(answer["stale"])
            raise Stale(self.why)
        return int(answer["pid"])

    def exit_code(self, pid: int) -> int | None:
        try:
            code = self._ask({"op": "status", "pid": pid}).get("code")
        except OSError:
            return None
        return None if code is None else int(code)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def busy(self) -> bool:
        """Whether a child of this server still runs (or waits to be launched)."""
        self.children = [c for c in self.children if c.poll() is None]
        return bool(self.children)

    def close(self) -> None:
        try:
            self._sock.close()  # the server reads the end of its socket and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            self._log.close()
        except OSError:
            pass


_SERVERS: dict[tuple[str, tuple[tuple[str, str], ...]], ForkServer] = {}
_SERVERS_LOCK = threading.Lock()
_RETIRED: list[ForkServer] = []
"""Stale servers (`ForkServer.stale`) with children still running: stopped once they have none."""
_NUMBER = itertools.count()


def _key(env: dict[str, str], cwd: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return cwd, tuple(sorted((k, v) for k, v in env.items() if k not in PER_PROCESS))


def server_for(env: dict[str, str], cwd: str, log_dir: Path, child: Child | None = None) -> ForkServer:
    """The fork server of ``env`` and ``cwd`` in this process, started on first use (one that died is
    replaced); ``child`` is counted as its child at once (a busy server is never stopped)."""
    key = _key(env, cwd)
    stopped = []
    with _SERVERS_LOCK:
        server = _SERVERS.pop(key, None)  # put back last: the most recently used
        if server is not None and server.stale:
            _RETIRED.append(server)
        for old in [s for s in _RETIRED if not s.busy()]:  # a stale server stays while a child of it runs
            _RETIRED.remove(old)
            stopped.append(old)
        if server is None or server.stale or (server.ready.is_set() and server.fork and not server.alive()):
            idle = [k for k, s in _SERVERS.items() if not s.busy()]
            for k in idle[:max(len(idle) - MAX_IDLE_SERVERS, 0)]:
                stopped.append(_SERVERS.pop(k))
            base = {k: v for k, v in env.items() if k not in PER_PROCESS}
            log_dir.mkdir(parents=True, exist_ok=True)
            server = ForkServer(base, cwd, log_dir / f"fork-server-{os.getpid()}-{next(_NUMBER)}.log")
        _SERVERS[key] = server
        if child is not None:
            server.children.append(child)
    for s in stopped:
        s.close()
    return server


def server_pids() -> list[int]:
    """The processes of this process's fork servers (kept for the next worker: not leftovers of a run)."""
    with _SERVERS_LOCK:
        return [s.proc.pid for s in list(_SERVERS.values()) + _RETIRED if s.alive()]


def close_servers() -> None:
    """Stop every fork server of this process (the ranks they forked die with them)."""
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values()) + _RETIRED
        _SERVERS.clear()
        _RETIRED.clear()
    for s in servers:
        s.close()


atexit.register(close_servers)


class Child:
    """A worker process with ``stdin`` and ``stdout`` pipes: forked by a fork server, or started.  The pipes exist
    at once; the process a moment later (``pid`` waits for it).  `subprocess.Popen`'s ``poll``, ``wait``, ``kill``
    and ``returncode``, and ``kill_group`` for a child in its own session."""

    def __init__(self, module: str, env: dict[str, str], cwd: str, stderr: IO[bytes], session: bool,
                 log_dir: Path) -> None:
        child_in, our_in = os.pipe()
        our_out, child_out = os.pipe()
        self.stdin: IO[bytes] = os.fdopen(our_in, "wb")
        self.stdout: IO[bytes] = os.fdopen(our_out, "rb")
        self.forked = False
        self.returncode: int | None = None
        self._pid: int | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._pidfd: int | None = None
        self._server: ForkServer | None = None
        self._launched = threading.Event()
        self._log_dir = log_dir
        self._killed = False
        self._lock = threading.Lock()
        fds = [child_in, child_out, os.dup(stderr.fileno())]
        if enabled(env):  # on the server's launcher thread, once the server is up
            self._server = server_for(env, cwd, log_dir, self)
            self._server.submit(lambda: self._launch(module, env, cwd, fds, session))
        else:  # started here, as without a fork server
            self._launch(module, env, cwd, fds, session)

    def _launch(self, module: str, env: dict[str, str], cwd: str, fds: list[int], session: bool) -> None:
        try:
            server = self._server
            if server is not None and server.fork:
                try:
                    pid: int | None = server.fork_child(module, env, cwd, fds, session)
                except Stale:  # a tree under edit: a new server imports it as it is now
                    server.children.remove(self)
                    server = self._server = server_for(env, cwd, self._log_dir, self)
                    server.ready.wait()
                    try:
                        pid = server.fork_child(module, env, cwd, fds, session) if server.fork else None
                    except OSError:
                        pid = None
                except OSError:  # the server died: this child is started instead
                    pid = None
                if pid is not None:
                    self.forked, self._pid = True, pid
                    try:
                        self._pidfd = os.pidfd_open(pid)
                    except ProcessLookupError:  # gone already (and reaped by the server)
                        self.returncode = server.exit_code(pid)
                        if self.returncode is None:
                            self.returncode = 1
                    return
            self._popen = subprocess.Popen([sys.executable, "-m", f"zerostate.harness.{module}"], stdin=fds[0],
                                           stdout=fds[1], stderr=fds[2], env=env, cwd=cwd,
                                           start_new_session=session)
            self._pid = self._popen.pid
        finally:
            for fd in fds:
                os.close(fd)
            self._launched.set()
            with self._lock:
                killed = self._killed
            if killed:
                self.kill()

    @property
    def pid(self) -> int:
        self._launched.wait()
        if self._pid is None:
            raise OSError("the worker process did not start")
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self._launched.is_set():
            return None
        if self._popen is not None:
            self.returncode = self._popen.poll()
        elif self._pidfd is not None:
            if select.select([self._pidfd], [], [], 0)[0]:
                self._exited()
        else:
            self.returncode = 1  # it never started
        return self.returncode

    def _exited(self) -> None:
        """The exited child's code, from its server (whose status request reaps it first); a server gone meanwhile
        cannot say it: read as killed."""
        code = self._server.exit_code(self._pid) if self._server is not None and self._pid is not None else None
        self.returncode = code if code is not None else -int(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if not self._launched.wait(timeout):
            raise subprocess.TimeoutExpired("zerostate.harness worker", timeout or 0)
        if self._popen is not None:
            self.returncode = self._popen.wait(timeout)
            return self.returncode
        if self.poll() is not None:
            return int(self.returncode or 0)
        assert self._pidfd is not None
        if not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("zerostate.harness worker", timeout or 0)
        self._exited()
        return int(self.returncode or 0)

    def kill(self, group: bool = False) -> None:
        """SIGKILL the process (``group``: its whole session's process group); before it exists, as soon as it does."""
        with self._lock:
            if not self._launched.is_set():
                self._killed = True
                return
        if self._pid is None or self.poll() is not None:
            return
        if group:
            try:
                os.killpg(self._pid, signal.SIGKILL)
                return
            except OSError:  # no group of its own (yet): the process alone
                pass
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                os.kill(self._pid, signal.SIGKILL)
        except OSError:
            pass

    def close(self) -> None:
        """Close the pipes and the process handle (a started process: reaped, once killed or exited)."""
        for f in (self.stdin, self.stdout):
            try:
                f.close()
            except OSError:  # a pipe whose reader died: nothing left to flush
                pass
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._popen is not None:
            self._popen.wait()


def start_child(module: str, env: dict[str, str], cwd: Path, stderr: IO[bytes], session: bool = False,
                log_dir: Path | None = None) -> Child:
    """A ``module`` worker (``worker`` or ``rank_worker``) with ``env`` in ``cwd``, its stderr ``stderr``:
    forked from the fork server of ``env`` and ``cwd`` (started now if none), or started (`ENV`)."""
    return Child(module, env, str(cwd), stderr, session, log_dir or cwd)


__all__ = ["ENV", "Child", "ForkServer", "Stale", "close_servers", "disabled", "enabled", "server_for", "server_pids",
           "start_child"]
