"""The pairwise completion's forced draws, made in helper processes a few pairs ahead (`DrawPool`).

`pairs.complete` draws `pairs.DRAWS` scenarios for each pair it tries, and most pairs it tries prove not
drawable (`benchmarks/bench_completion.py` times it); a worker that has run its generated lane waits for the
completion's first lane meanwhile.  A pair's
draws are a function of (pair, seed) alone (`pairs.draws`), so they can be made anywhere: the pool draws the
pair asked for and the next ones `complete` will likely ask for, in ``jobs`` processes.  `complete` picks from
the same draws in the same order, so the completion is the one drawn in-process; a pair drawn ahead and then
taken by another example costs only a helper's otherwise idle time.

The helpers are ``python -m zerostate.explorer.draw_pool`` processes reading one pair per line and writing its
draws as one JSON line of scenario dicts, parsed back into scenarios on receipt (not `multiprocessing`, whose
spawned children re-import the caller's ``__main__``).  A helper that fails is a harness error, never a silent
change of the completion: the draws are then made here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from zerostate.model.scenario import Scenario

from zerostate.explorer.pairs import Pair, draws

_Draws = tuple[Scenario, ...] | None


HELPER = (sys.executable, "-m", "zerostate.explorer.draw_pool")
"""The command a helper runs."""
NICE = 10
"""How much lower a helper's priority is than the exploration's: its draws run while the workers run the generated
lanes (`first_round`), and should take only the CPU they leave."""


class _Helper:
    """One helper process and the pair it is drawing (None: idle)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(list(HELPER), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        self.pair: Pair | None = None

    def ask(self, pair: Pair, seed: int | None) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([list(pair), seed]) + "\n")
        self.proc.stdin.flush()
        self.pair = pair

    def answer(self) -> _Draws:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.pair = None
        if not line:
            raise RuntimeError("a draw helper ended")
        got = json.loads(line)
        return None if got is None else tuple(Scenario.from_dict(d) for d in got)

    def close(self) -> int:
        """End the helper; its exit status.  One still drawing (or blocked writing an answer nobody will read) is
        killed; an idle one ends at the end of its input."""
        if self.pair is not None:
            self.proc.kill()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:  # it ended already
                pass
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class DrawPool:
    """A `pairs.Drawer` over ``jobs`` helper processes (started at the first pair); ``close()`` ends them."""

    def __init__(self, seed: int | None, jobs: int):
        self.seed, self.jobs = seed, max(1, jobs)
        self.helpers: list[_Helper] = []
        self.done: dict[Pair, _Draws] = {}
        self.failure: str | None = None
        """Why the helpers were given up (the draws are made here since), or None."""

    def __call__(self, pair: Pair, nxt: Sequence[Pair]) -> _Draws:
        if pair in self.done:
            return self.done.pop(pair)
        if self.failure is None:
            try:
                return self._drawn(pair, nxt)
            except (OSError, RuntimeError, ValueError) as exc:
                self.failure = f"{type(exc).__name__}: {exc} (helper exit status {self._stop()})"
        return draws(pair, self.seed)

    def _drawn(self, pair: Pair, nxt: Sequence[Pair]) -> _Draws:
        if not self.helpers:
            self.helpers = [_Helper() for _ in range(self.jobs)]
        window = (pair, *nxt[: self.jobs])
        for h in self.helpers:  # a pair drawn ahead that another example took: its helper is free for the window
            if h.pair is not None and h.pair not in window:
                h.answer()
        busy = {h.pair for h in self.helpers if h.pair is not None}
        want = [p for p in window if p not in busy and p not in self.done]
        for h in self.helpers:
            if h.pair is None and want:
                h.ask(want.pop(0), self.seed)
        while pair not in self.done:  # the helper drawing it, else any busy one (then it draws ``pair``)
            h = next((h for h in self.helpers if h.pair == pair), None) or \
                next(h for h in self.helpers if h.pair is not None)
            asked = h.pair
            assert asked is not None
            self.done[asked] = h.answer()
            if want:
                h.ask(want.pop(0), self.seed)
        return self.done.pop(pair)

    def _stop(self) -> str:
        """End the helpers; their exit statuses."""
        statuses = ", ".join(str(h.close()) for h in self.helpers)
        self.helpers = []
        return statuses

    def close(self) -> None:
        self._stop()
        self.done.clear()

    def __enter__(self) -> DrawPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve() -> None:
    """A helper: for each line ``[pair, seed]`` on stdin, one line of its draws (a list of scenario dicts, or
    null).
    It ends when stdin closes; a Ctrl-C at the terminal is the exploration's to handle, not its helpers'."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # no nice (another OS): the same draws, at normal priority
        os.nice(NICE)
    for line in sys.stdin:
        pair, seed = json.loads(line)
        got = draws((pair[0], pair[1], pair[2], pair[3]), seed)
        sys.stdout.write(json.dumps(None if got is None else [sc.to_dict() for sc in got]) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()

__all__ = ["HELPER", "NICE", "DrawPool"]
