"""One worker process and its JSON-lines pipe: `Worker`, and the two ways a request fails."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

from zerostate.harness import envs


class WorkerTimeout(RuntimeError):
    pass


class WorkerDied(RuntimeError):
    pass


def default_timeout() -> float:
    return float(os.environ.get("ZEROSTATE_EXAMPLE_TIMEOUT", "60"))


class Worker:
    """One worker process and its JSON-lines pipe."""

    def __init__(self, env: dict[str, str], log_path: Path, cwd: Path | None = None):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        cwd = cwd or envs.cache_root()
        cwd.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "zerostate.harness.worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, cwd=str(cwd))
        self._buf = b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()[-n:]
        except OSError:
            return ""
        return data.decode(errors="replace")

    def request(self, obj: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerDied(f"the worker exited (code {self.proc.poll()})") from None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
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
        return json.loads(line)

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if not kill:
                try:
                    self.proc.stdin.write(b'{"op": "exit"}\n')
                    self.proc.stdin.flush()
                    self.proc.wait(timeout=10)
                except Exception:
                    pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._sel.close()
        self._log.close()


__all__ = ["Worker", "WorkerDied", "WorkerTimeout", "default_timeout"]
