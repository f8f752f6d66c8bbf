"""One worker process and its JSON-lines pipe: `Worker`, and the two ways a request fails."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from pathlib import Path
from typing import IO, Protocol, cast

from zerostate.harness import envs
from zerostate.harness.forked import start_child
from zerostate.harness.protocol import Request, Response


class WorkerTimeout(RuntimeError):
    """No answer within the request's timeout."""


class WorkerDied(RuntimeError):
    """The worker process is gone."""


class WorkerLike(Protocol):
    """What a target drives: one worker process (`Worker`) or a rank pool (`rank_pool.RankPool`)."""

    log_path: Path

    @property
    def forked(self) -> bool:
        """Forked from a fork server (every rank of a pool), not started as a new process."""
        ...

    def alive(self) -> bool: ...

    def log_tail(self, n: int = 3000) -> str: ...

    def request(self, obj: Request, timeout: float) -> Response: ...

    def close(self, kill: bool = False) -> None: ...


def default_timeout() -> float:
    return float(os.environ.get("ZEROSTATE_EXAMPLE_TIMEOUT", "60"))


class Worker:
    """One worker process and its JSON-lines pipe."""

    def __init__(self, env: dict[str, str], log_path: Path, cwd: Path | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 -- the worker's stderr for its whole life; close() closes it
        cwd = cwd or envs.cache_root()
        cwd.mkdir(parents=True, exist_ok=True)
        self.proc = start_child("worker", env, cwd, self._log, log_dir=log_path.parent)
        self._stdin: IO[bytes] = self.proc.stdin
        self._stdout: IO[bytes] = self.proc.stdout
        self._buf = b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._stdout, selectors.EVENT_READ)

    @property
    def forked(self) -> bool:
        return self.proc.forked

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()[-n:]
        except OSError:
            return ""
        return data.decode(errors="replace")

    def request(self, obj: Request, timeout: float) -> Response:
        """Send one request; its answer within ``timeout`` seconds, else `WorkerTimeout`;
        `WorkerDied` when the process is gone."""
        try:
            self._stdin.write((json.dumps(obj) + "\n").encode())
            self._stdin.flush()
        except OSError:  # BrokenPipeError included
            raise WorkerDied(f"the worker exited (code {self.proc.poll()})") from None
        deadline = time.monotonic() + timeout
        fd = self._stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeout(f"no answer within {timeout:.0f} s")
            if not self._sel.select(left):
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self.proc.wait(timeout=5)
                raise WorkerDied(f"the worker exited (code {self.proc.returncode})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return cast(Response, json.loads(line))

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if not kill:
                try:
                    self._stdin.write(b'{"op": "exit"}\n')
                    self._stdin.flush()
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):  # gone already, or deaf: killed below
                    pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._sel.close()
        self.proc.close()
        self._log.close()


__all__ = ["Worker", "WorkerDied", "WorkerLike", "WorkerTimeout", "default_timeout"]
