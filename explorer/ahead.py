"""Shrinking on every worker: the searches of the keys next in line run ahead, their runs kept for the in-order pass.

Shrinking is one pass over the keys in order (`Exploration._shrink`): each key's search and polish against the memo
of every run before it, the distinct runs capped by `hard_cap`.  That pass stays one sequence, so the findings do not
depend on ``--jobs``; what `Ahead` moves onto the other workers is only its *runs*.  The keys next in line (at most
one per worker beyond the current one) are searched and polished ahead, each on one worker, every scenario run once
(`ran`, shared by all); the in-order pass then makes the same requests in the same order (the same searches of the
same outcomes), finds each run made (`run`) and records it as its own, against its cap and its hang limit.  What the
searches ahead did not reach (a search cut short by a stop, the hang limit, a key first met meanwhile) it runs
itself, on its own worker.  A key whose turn comes while another worker still searches it is waited for; the pass's
worker meanwhile searches the next key not taken.  Beyond the cap, what ran ahead is thrown away.

Each run keeps the runs its worker made before it since that worker's last fresh start (``history``): a finding that
only shows after them is confirmed as order-dependent with those (`confirm`), whichever worker ran it.

The helper workers replay confirmations first (`ConfirmQueue`, served from here) and search ahead when none waits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from collections.abc import Callable

from zerostate.explorer.confirm import ConfirmQueue
from zerostate.explorer.generate import Abort
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Target

HANG_RUNS = 3
"""Runs that hung while one key is searched ahead: the rest of that key waits for its turn in the pass (whose own
hang limit, `exploration.HANG_SHRINK_RUNS`, decides how far it goes)."""


@dataclass(frozen=True)
class Ran:
    """One run made ahead: its outcome, whether its worker was restarted by it, what that worker ran before it
    since its last fresh start, and which worker it was (0: the pass's own)."""

    outcome: Outcome
    restarted: bool
    history: tuple[Scenario, ...]
    worker: int


@dataclass(frozen=True)
class Searched:
    """A key's Hypothesis search made ahead, whole: the scenarios it asked to run, in order (those the memo did not
    hold then), and the one it ended on.  The pass walks these instead of searching again: the same search of the
    same outcomes asks for the same scenarios, and a scenario the memo holds at the pass's turn it skips as its own
    search would have."""

    asked: tuple[Scenario, ...]
    found: Scenario | None


Search = Callable[[str, Callable[[Scenario], Outcome]], Searched]
"""Search and polish one key (the in-order pass's own code, with its events dropped), every run through the given
function; returns the search's record (the polish the pass makes again: it draws nothing)."""


class Ahead:
    """The searches ahead of the in-order pass, on ``workers`` (the first is the pass's own: it searches ahead only
    in the pass's thread, while waiting; the others each in a thread of theirs, after the confirmations)."""

    def __init__(self, workers: list[Target], search: Search, confirms: ConfirmQueue,
                 known: Callable[[Scenario], Outcome | None], since_fresh: list[list[Scenario]]):
        self.workers = workers
        self._search = search
        self._known = known
        self.confirms = confirms
        self.ran: dict[Scenario, Ran] = {}
        self.searched: dict[str, Searched] = {}
        """Key -> its search made ahead, whole (a search cut short by a stop or the hang limit is not here)."""
        self._since_fresh = [list(h) for h in since_fresh]
        """Per worker, what it ran since its last fresh start (a helper: its last lane's runs, to begin with)."""
        self._line: list[str] = []
        self._taken: dict[str, threading.Event] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        """No more searching ahead (the cap, a stop): runs asked for from now on are made only by the pass."""
        self._closed = threading.Event()
        self._errors: list[BaseException] = []
        confirms.served_elsewhere()
        self._threads = [threading.Thread(target=self._help, args=(i,), daemon=True, name=f"explore-ahead-{i}")
                         for i in range(1, len(workers))]
        for th in self._threads:
            th.start()

    # ------------------------------------------------------------ the pass's side
    def line(self, keys: list[str]) -> None:
        """The keys not shrunk yet, in the order the pass takes them (the first is its current one)."""
        with self._cond:
            self._line = list(keys)
            self._cond.notify_all()

    def ready(self, key: str) -> None:
        """Return once ``key``'s search ahead has ended: searched here, on the pass's worker, when no helper took
        it; while a helper searches it, the next key in line no worker took is searched here meanwhile."""
        while True:
            self._raise_helper_error()
            with self._cond:
                done = self._taken.get(key)
                mine = None
                if done is None:
                    mine = key
                elif not done.is_set():
                    mine = self._next_untaken()
                if mine is not None:
                    self._taken[mine] = threading.Event()
            if mine is not None:
                self._search_ahead(mine, 0)
                continue
            if done is not None and done.wait(timeout=0.2):
                return

    def run(self, sc: Scenario, worker: int = 0) -> Ran:
        """``sc``'s run: made ahead, else made now on ``worker`` (the pass's own)."""
        got = self.ran.get(sc)
        if got is not None:
            return got
        return self._make(sc, worker)

    def stop(self) -> None:
        """Search ahead no more (the pass hit its cap or was told to stop); confirmations go on."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Search ahead no more and tell the helpers to end after their current run (the caller closes their
        workers, which ends a run in flight at once); `join` waits for them."""
        self.stop()
        self._closed.set()
        with self._cond:
            self._cond.notify_all()

    def join(self) -> None:
        for th in self._threads:
            th.join(timeout=30)

    # ------------------------------------------------------------ searching ahead
    def _next_untaken(self) -> str | None:
        """The next key in line no worker took, within one per worker of the current key (beyond that, a search
        would more likely be thrown away at the cap than used)."""
        if self._stop.is_set():
            return None
        return next((k for k in self._line[:len(self.workers) + 1] if k not in self._taken), None)

    def _search_ahead(self, key: str, worker: int) -> None:
        hung = [0]

        def run(sc: Scenario) -> Outcome:
            if self._stop.is_set() or hung[0] >= HANG_RUNS:
                raise Abort()
            known = self._known(sc)
            if known is not None:
                return known
            got = self.run(sc, worker)
            hung[0] += any(f.check == "hang" for f in got.outcome.findings)
            return got.outcome
        try:
            self.searched[key] = self._search(key, run)
        except Abort:
            pass
        finally:
            with self._cond:
                self._taken[key].set()
                self._cond.notify_all()

    def _make(self, sc: Scenario, worker: int) -> Ran:
        w = self.workers[worker]
        before = w.restarts
        out = w.run(sc)
        restarted = w.restarts != before
        history = tuple(self._since_fresh[worker])
        self._since_fresh[worker] = [] if restarted else self._since_fresh[worker] + [sc]
        got = Ran(out, restarted, history, worker)
        self.ran.setdefault(sc, got)
        return self.ran[sc]

    def _help(self, worker: int) -> None:
        """A helper: the confirmations first, then the next key in line no worker took, until closed."""
        w = self.workers[worker]
        try:
            while not self._closed.is_set():
                job = self.confirms.take()
                if job is not None:
                    c = self.confirms.replay(job, w)
                    if c is None:  # the worker broke
                        return
                    self._since_fresh[worker] = list(c.last_run)
                    continue
                with self._cond:
                    key = self._next_untaken()
                    if key is None:
                        self._cond.wait(timeout=0.2)
                        continue
                    self._taken[key] = threading.Event()
                self._search_ahead(key, worker)
        except BaseException as exc:  # noqa: BLE001 -- raised in the pass's thread
            self._errors.append(exc)

    def _raise_helper_error(self) -> None:
        if self._errors:
            raise self._errors[0]


__all__ = ["Ahead", "HANG_RUNS", "Ran", "Search", "Searched"]
