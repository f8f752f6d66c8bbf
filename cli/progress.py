"""A one-line progress display for long runs: on a terminal only, never in CI logs.

Shown when stderr is a TTY and ``CI`` is not set to true; otherwise every call
is a no-op, so CI logs carry only the final summary.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


def interactive(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stderr
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """``update(examples=..., findings=...)`` redraws one status line at most ten times a second."""

    def __init__(self, what: str = "explore", stream: TextIO | None = None, enabled: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = interactive(self.stream) if enabled is None else enabled
        self.what = what
        self.start = time.monotonic()
        self._last = 0.0
        self._width = 0

    def update(self, examples: int = 0, findings: int = 0, extra: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        line = (f"{self.what}: {examples} example(s) run, {findings} finding(s), "
                f"{now - self.start:.0f}s elapsed" + (f", {extra}" if extra else ""))
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


def note(message: str, stream: TextIO | None = None) -> None:
    """One line on a terminal (``zerostate: message``); nothing in CI logs or pipes."""
    stream = stream or sys.stderr
    if interactive(stream):
        stream.write(f"zerostate: {message}\n")
        stream.flush()


__all__ = ["Progress", "interactive", "note"]
