"""The one fold of spec monitors over events: a finished trace's check, the model checker's state graph and the watch.

[Note: what a fold does after a failure]  A monitor step that returns a `Failure` reports a violation at that
event; the failing monitor then keeps its state from before the failing event and the fold goes on.  A spec that
fails again with the same message at its next reacting events is the same violation still failing, reported once
(an event the spec passes ends it).  Why this one semantics for every user: ``zerostate watch`` judges jobs that
run for hours, and a spec that stopped at its first violation would judge nothing after it (restarting it from
its initial state would misread what DeepSpeed holds: the trace mode, the gathered parameters).  Up to a spec's
first failure nothing differs from a fold that stops there, and the first failure is all that `first_violation`
(``specs.check_trace``, the findings decider) and the state graph (`MonitorBank`, which collapses a failed spec
to `DEAD` on that path so that equal futures merge) read.

Dispatch by kind: a spec's step returns its state itself for every kind outside ``reacts_to``, so the fold hands
an event only to the specs that react to it.  The transition memo (``memo=True``, the watch): a job repeats itself,
every step the same events in the same monitor states, so the states of the memoised specs form one product state
with an id and (product state, event) -> (next product state, the states that change) is filed the first time it
is folded without a failure; afterwards it is one dict lookup.  Events are filed without their graph task (each
backward's tasks are new ids); specs whose next state depends on the task are left out (``unmemoized``).

Pure Python: specs and events only (no torch).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .events import Event, EventKind
from .failure import Failure, Violation, violation
from .protocols import Monitor

States = tuple[Any, ...]
"""One monitor state per spec, in the specs' order (a product state of the state graph)."""
MemoEntry = tuple[Event, int, tuple[tuple[str, Any], ...]]
"""(event, next product id, (spec id, next state) of the states that change)."""

MEMO_MAX = 100_000
"""Transitions the memo holds before it starts again empty."""
MEMO_STATES = 20_000
"""Product states it holds (each keeps its monitor states alive) before it starts again empty.  When it fills up
having answered fewer events than it missed, it is switched off (each spec folded, as without it)."""


OnFailure = Callable[[str, Failure, "int | None"], None]
"""(spec id, failure, event index or None at the end) -- called for each new violation."""


class Fold:
    """Spec monitors folded online over a stream of events (`feed`, `feed_many`), with the semantics of the module's
    note.  ``state``: spec id -> monitor state; ``index``: events folded so far."""

    def __init__(self, specs: Iterable[Monitor], on_failure: OnFailure | None = None, memo: bool = False,
                 unmemoized: frozenset[str] = frozenset()) -> None:
        self.on_failure = on_failure
        self.use_memo = memo
        self.unmemoized = unmemoized
        self.index = 0
        self.set_specs(specs)

    # ------------------------------------------------------------ specs
    def set_specs(self, specs: Iterable[Monitor]) -> None:
        """Fold ``specs`` from now on (from their initial states)."""
        self.specs = list(specs)
        self.state: dict[str, Any] = {s.id: s.init() for s in self.specs}
        self.failing: dict[str, str] = {}
        """spec -> the message it failed with at its last reacting event (still failing: not reported again)."""
        self._by_kind = {k: tuple((s.id, s.step) for s in self.specs if s.reacts_to is None or k in s.reacts_to)
                         for k in EventKind}
        self._ids_by_kind = {k: frozenset(sid for sid, _ in v) for k, v in self._by_kind.items()}
        self._memo_ids = tuple(s.id for s in self.specs if s.id not in self.unmemoized)
        self._direct = {k: tuple((sid, step) for sid, step in v if sid in self.unmemoized)
                        for k, v in self._by_kind.items()}
        """kind -> (spec id, step) of the reacting specs the memo leaves out (folded at every event)."""
        self._memo_reset()

    def restart(self, spec_id: str) -> None:
        """Start ``spec_id``'s monitor again from its initial state (the observer has just synchronised with what it
        observes: the watch's trace mode, `zerostate.watcher.tracer.WatchTracer`)."""
        for s in self.specs:
            if s.id == spec_id:
                self.state[spec_id] = s.init()
                self.failing.pop(spec_id, None)
        self._pid = self._intern()

    # ------------------------------------------------------------ the transition memo
    def _memo_reset(self) -> None:
        self._memo: dict[tuple[int, int], MemoEntry] | None = {} if self.use_memo else None
        """(product id, id(event)) -> (event, next product id, ((spec id, next state), ...) for the states that
        change).  The event is kept in the value: its id stays its own while the entry lives."""
        self._twins: dict[tuple[Any, ...], Event] = {}
        self._pids: dict[States, int] = {}
        self._next_pid = 0
        self._misses = 0
        """Transitions folded spec by spec since the memo last started empty."""
        self._since = self.index
        self._pid = None
        self._pid = self._intern()

    def _task_free(self, ev: Event) -> Event:
        """``ev`` without its graph task: the key the memo files it under."""
        key = (ev.kind, ev.param, ev.module, ev.value, ev.phase, ev.note)
        twin = self._twins.get(key)
        if twin is None:
            twin = self._twins[key] = Event(ev.kind, ev.param, ev.module, None, ev.value, ev.phase, ev.note)
        return twin

    def _intern(self) -> int | None:
        """The id of the current product state (None: the memo is off, or a state is not hashable)."""
        if self._memo is None:
            return None
        prod = tuple(self.state[sid] for sid in self._memo_ids)
        try:
            pid = self._pids.get(prod)
        except TypeError:  # a spec whose state is not hashable: fold without the memo
            self._memo = None
            return None
        if pid is None:
            if len(self._pids) >= MEMO_STATES or len(self._memo) >= MEMO_MAX:
                if self.index - self._since - self._misses < self._misses:  # more misses than hits: not worth it
                    self._memo = None
                    self._pids.clear()
                    self._twins.clear()
                    return None
                self._pids.clear()
                self._memo.clear()
                self._twins.clear()
                self._misses, self._since = 0, self.index
            pid = self._pids[prod] = self._next_pid  # never reused: an entry under a cleared id stays unmatched
            self._next_pid += 1
        return pid

    # ------------------------------------------------------------ folding
    def feed(self, ev: Event) -> None:
        self.feed_many(collections.deque((ev,)))

    def feed_many(self, queue: collections.deque[Event], before: Callable[[int, Event], None] | None = None,
                  after: Callable[[int, Event], None] | None = None) -> None:
        """Fold the events of ``queue``, taking them from its left until it is empty (one at a time: an exception --
        Ctrl-C -- inside a step leaves the events after it queued).  ``before(i, ev)`` runs before event ``i`` is
        folded (a violation at it sees it), ``after(i, ev)`` once it is."""
        pop = queue.popleft
        state, failing, direct = self.state, self.failing, self._direct
        while queue:
            ev = pop()
            i = self.index
            self.index = i + 1
            if before is not None:
                before(i, ev)
            if ev.kind is EventKind.ENGINE_START:  # a fresh engine: every monitor starts over from here
                self._close(i)
                if after is not None:
                    after(i, ev)
                continue
            pid = self._pid
            hit = None
            if not failing and pid is not None:
                key_ev = ev if ev.task is None else self._task_free(ev)
                hit = self._memo.get((pid, id(key_ev)))  # type: ignore[union-attr]
                if hit is not None and hit[0] is not key_ev:
                    hit = None
            if hit is not None:  # this product state has seen this event: no memoised spec fails
                self._pid = hit[1]
                for sid, m in hit[2]:
                    state[sid] = m
                for sid, step in direct[ev.kind]:
                    m = step(state[sid], ev)
                    if m.__class__ is Failure:
                        self._failed(sid, m, i)
                    else:
                        state[sid] = m
            else:
                self._fold(ev, i)
            if after is not None:
                after(i, ev)

    def _failed(self, sid: str, f: Failure, i: int | None) -> None:
        """A failure at event ``i``: reported unless the spec is still failing with the same message; the monitor
        keeps its state from before the event."""
        if self.failing.get(sid) != f.message and self.on_failure is not None:
            self.on_failure(sid, f, i)
        self.failing[sid] = f.message

    def _fold(self, ev: Event, i: int) -> None:
        """Event ``i`` spec by spec (a memo miss, or a check is failing); files the transition in the memo when no
        memoised spec fails or was failing."""
        state, failing = self.state, self.failing
        k = ev.kind
        pid = self._pid
        memo = pid is not None and not failing
        before: list[Any] = []
        if memo:
            self._misses += 1
            before = [state[sid] for sid in self._memo_ids]
        if failing:  # a spec that ignores this kind passes it: it is no longer failing
            reacting = self._ids_by_kind[k]
            for sid in [sid for sid in failing if sid not in reacting]:
                del failing[sid]
        for sid, step in self._by_kind[k]:
            m = step(state[sid], ev)
            if m.__class__ is Failure:
                self._failed(sid, m, i)
                if sid not in self.unmemoized:
                    memo = False
                continue
            if failing:
                failing.pop(sid, None)
            state[sid] = m
        if self._memo is not None:
            new = self._pid = self._intern()
            if memo and new is not None:
                key_ev = ev if ev.task is None else self._task_free(ev)
                changed = tuple((sid, state[sid]) for sid, old in zip(self._memo_ids, before, strict=True)
                                if state[sid] is not old)
                self._memo[(pid, id(key_ev))] = (key_ev, new, changed)  # type: ignore[index]

    def finish(self) -> None:
        """The end of the run: each spec's obligations still open (a backward whose epilogue never ran...) are
        reported (index None); the monitors start again from their initial states."""
        self._close(None)

    def _close(self, index: int | None) -> None:
        """Each spec's open obligations reported at ``index`` (None: the end of the run), then every monitor starts
        again from its initial state (the run's end, or a fresh engine's start: ENGINE_START)."""
        for s in self.specs:
            end = s.finish(self.state[s.id])
            if end and self.on_failure is not None:
                self.on_failure(s.id, end if isinstance(end, Failure) else Failure(end), index)
            self.state[s.id] = s.init()
        self.failing.clear()
        self._pid = self._intern()


def first_violation(spec: Monitor, events: Iterable[Event]) -> Violation | None:
    """The fold of one spec over a finished trace: its first violation, or its end-of-run obligation's."""
    found: list[Violation] = []
    fold = Fold((spec,), on_failure=lambda sid, f, i: found.append(violation(sid, f, i)))
    for ev in events:
        fold.feed(ev)
        if found:
            return found[0]
    fold.finish()
    return found[0] if found else None


def advance(specs: Sequence[Monitor], states: States, events: Sequence[Event],
            base: int = 0) -> tuple[States, dict[str, tuple[int, Failure]]]:
    """The fold as a pure function of product states (the state graph): ``events`` folded into ``states`` (one per
    spec, in order); returns the new states and each spec's first failure here (index ``base`` + position)."""
    out: list[Any] = []
    failed: dict[str, tuple[int, Failure]] = {}
    for spec, m in zip(specs, states, strict=False):
        reacts = spec.reacts_to
        cur = m
        for i, ev in enumerate(events):
            if reacts is not None and ev.kind not in reacts:
                continue
            nxt = spec.step(cur, ev)
            if nxt.__class__ is Failure:
                failed.setdefault(spec.id, (base + i, nxt))
                continue
            cur = nxt
        out.append(cur)
    return tuple(out), failed


class MonitorBank:
    """The fold for the model checker's state graph (`zerostate.model.explore.state_graph`) and the models' tests:
    monitor states as tuples.  The graph needs each spec's first counterexample only, so `advance` collapses a spec
    that failed on a path to `DEAD` there (equal futures then merge); `feed` / `finish` keep the states and the
    first failure of each spec on the bank (one run)."""

    def __init__(self, specs: Iterable[Monitor]) -> None:
        self.specs = tuple(specs)
        self.states = self.initial()
        self.failures: dict[str, tuple[int | None, Failure]] = {}
        self.seen = 0

    def initial(self) -> States:
        return tuple(s.init() for s in self.specs)

    def advance(self, states: States, events: Sequence[Event],
                base: int = 0) -> tuple[States, dict[str, tuple[int, Failure]]]:
        """`advance` over the live monitors of ``states``; a spec that fails becomes `DEAD`.  Returns the new states
        and, per newly failed spec, (index of the event = ``base`` + position, failure)."""
        live = [i for i, m in enumerate(states) if m is not DEAD]
        new, failed = advance([self.specs[i] for i in live], tuple(states[i] for i in live), events, base)
        out = list(states)
        for i, m in zip(live, new, strict=False):
            out[i] = DEAD if self.specs[i].id in failed else m
        return tuple(out), failed

    def feed(self, events: Iterable[Event]) -> dict[str, tuple[int, Failure]]:
        events = list(events)
        self.states, failed = self.advance(self.states, events, self.seen)
        self.seen += len(events)
        for sid, f in failed.items():
            self.failures.setdefault(sid, f)
        return failed

    def ends(self, states: States) -> dict[str, Failure]:
        """End-of-run obligations of the live monitors in ``states``."""
        out = {}
        for spec, m in zip(self.specs, states, strict=False):
            if m is DEAD:
                continue
            end = spec.finish(m)
            if end:
                out[spec.id] = end if isinstance(end, Failure) else Failure(end)
        return out

    def finish(self) -> dict[str, tuple[int | None, Failure]]:
        for sid, f in self.ends(self.states).items():
            self.failures.setdefault(sid, (None, f))
        return self.failures


class _Dead:
    """The state of a monitor whose first failure the state graph has on this path: it judges nothing more."""

    def __repr__(self) -> str:
        return "<violated>"


DEAD = _Dead()

__all__ = ["DEAD", "Fold", "MEMO_MAX", "MEMO_STATES", "Monitor", "MonitorBank", "advance", "first_violation"]
