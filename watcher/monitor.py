"""Check every spec online, one event at a time, and measure ZeRO-3 memory as the job runs.

`OnlineChecker.feed(event)` folds the event into each spec's monitor (`zerostate.specs`, the same
monitors `check_trace` folds over a finished trace; no oracle).  A monitor that fails records a
violation -- spec, message, the events before it and the next ``AROUND`` after it, train step and
backward number -- and keeps its state from before the failing event, so the job keeps being checked
in step with DeepSpeed (restarting from the initial state would misread the trace mode, say).  A
violation with the same spec and message is counted, not stored again; a check that keeps failing with
the same message event after event counts once.

Memory (ZeRO-3): parameter elements gathered (AVAILABLE or INFLIGHT, from FETCH / PREFETCH / RELEASE)
-- the peak per user backward -- and all-gathers per train step (PREFETCH, and FETCH that did not wait on
a prefetch), as `zerostate.specs.coordinator_specs.gathered_peak` / ``allgathers`` count them; plus the
gathered-elements series of one train step (the second, whose trace is complete; the first if the job
has one step) for the picture.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable

from zerostate.model.events import EventKind, Event
from zerostate.specs import SPECS
from zerostate.specs.base import Spec, fail
from zerostate.specs.coordinator_specs import ancestor_regions, available_when_used

_FAILURE = type(fail("-"))
"""What a monitor step returns on a violation (`zerostate.specs.base.fail`); compared by class, per event."""

BEFORE = 120
"""Events kept before a violation (the trace picture's window)."""
AROUND = 8
"""Events kept after it."""
KEEP = 50
"""Distinct violations kept per spec (more are only counted)."""
SERIES_STEP = 1
UNMEMOIZED = frozenset({"count-once-per-phase"})
"""Specs the transition memo leaves out (`OnlineChecker.feed`): their state holds graph task ids, new every
backward, so product states holding it would never repeat.  (Leaving a spec out is only slower, never wrong.)"""
MEMO_MAX = 100_000
"""Transitions the memo holds before it starts again empty."""
MEMO_STATES = 20_000
"""Product states it holds (each keeps its monitor states alive: sets of up to one entry per parameter) before it
starts again empty.  A job that repeats itself needs about as many as it has events per step; when the memo
fills up having answered fewer events than it missed, it is switched off (each spec folded, as without it)."""
_MEMORY_KINDS = frozenset({EventKind.USER_BACKWARD_START, EventKind.USER_BACKWARD_END, EventKind.STEP, EventKind.FETCH, EventKind.PREFETCH, EventKind.RELEASE})
"""The kinds `OnlineChecker._memory` counts with (the others only extend a peak or the series)."""


class OnlineChecker:
    """Every spec folded online.  ``feed`` hands each event only to the specs whose ``reacts_to`` holds its kind
    (for every other kind a spec's step returns its state unchanged, `zerostate.specs.base.Spec.reacts_to`):
    the same states and violations as folding every spec over every event (compared on model traces by
    test_watch), at a fraction of the cost -- HOLDERS, a third of a ZeRO-3 job's events,
    concerns one spec.

    A training job repeats itself: every step brings the same events (the tracer hands out one shared `Event`
    per distinct event) in the same monitor states.  So ``feed`` memoizes the specs' transitions: the states
    of the memoized specs (all but `UNMEMOIZED`) are one product state with an id, and (product id, event) ->
    (next product id, the states that change) is filed the first time it is folded without a failure; the
    next time it is one dict lookup instead of ~2.5 spec steps (monitor steps are pure functions of (state,
    event), `zerostate.specs.base`).  Events that fail a memoized spec, and every event while a check is
    failing, are folded spec by spec as before.  test_watch compares the result with the full fold."""

    def __init__(self, numel: Callable[[str], int], specs=None, on_violation=None):
        self.set_specs(specs or SPECS.values())
        self.numel = numel
        self.on_violation = on_violation
        self.index = 0
        self.recent: collections.deque = collections.deque(maxlen=BEFORE)
        self.violations: list[dict[str, Any]] = []
        self._seen: dict[tuple[str, str], dict[str, Any]] = {}
        self._filling: list[dict[str, Any]] = []
        self._failing: dict[str, str] = {}
        """spec -> the message it failed with at its last event (a still-failing check is not counted again)."""
        self.steps = 0
        self.backwards = 0
        self.gathered: set[str] = set()
        self.total = 0
        self.peaks: list[int] = []
        """Gathered-element peak of each user backward (from its start to its end)."""
        self._peak: int | None = None
        self.allgathers: list[int] = []
        """All-gathers of each train step (events from one STEP to the next)."""
        self._ag = 0
        self.series: list[tuple[int, int, str]] = []
        """(event index, gathered elements, event kind) over one train step."""
        self._series_now: list[tuple[int, int, str]] = []
        self.context: dict[str, Any] = {}

    # ------------------------------------------------------------ feeding
    @property
    def events_seen(self) -> int:
        return self.index

    def set_specs(self, specs: Iterable[Spec]) -> None:
        """Check ``specs`` from now on (from their initial states)."""
        self.specs = list(specs)
        self.state = {s.id: s.init() for s in self.specs}
        self._by_kind = {k: tuple((s.id, s.step) for s in self.specs if s.reacts_to is None or k in s.reacts_to)
                         for k in EventKind}
        """kind -> (spec id, step) of the specs that react to it, in spec order."""
        self._ids_by_kind = {k: frozenset(sid for sid, _ in v) for k, v in self._by_kind.items()}
        self._memo_ids = tuple(s.id for s in self.specs if s.id not in UNMEMOIZED)
        self._direct = {k: tuple((sid, step) for sid, step in v if sid in UNMEMOIZED) for k, v in self._by_kind.items()}
        """kind -> (spec id, step) of the reacting specs the transition memo leaves out (run on every event)."""
        self._memo_reset()

    def restart(self, spec_id: str) -> None:
        """Start ``spec_id``'s monitor again from its initial state (the tracer has just synchronised with what
        it observes: `WatchTracer._poll_trace`)."""
        for s in self.specs:
            if s.id == spec_id:
                self.state[spec_id] = s.init()
                self._failing.pop(spec_id, None)
        self._pid = self._intern()

    # ------------------------------------------------------------ the transition memo
    def _memo_reset(self) -> None:
        self._memo: dict[tuple[int, int], tuple] | None = {}
        """(product id, id(event)) -> (event, next product id, ((spec id, next state), ...) for the states that
        change).  The event is kept in the value: its id stays its own while the entry lives."""
        self._twins: dict[tuple, Event] = {}
        self._pids: dict[tuple, int] = {}
        """Product state (the memoized specs' states, in ``_memo_ids`` order) -> its id."""
        self._next_pid = 0
        self._misses = 0
        """Transitions folded spec by spec since the memo last started empty."""
        self._since = getattr(self, "index", 0)
        """The event index at which it last started empty."""
        self._pid: int | None = None
        self._pid = self._intern()

    def _task_free(self, ev: Event) -> Event:
        """``ev`` without its graph task: the key the memo files it under.  Each backward's tasks are new ids, so
        keyed with them a job's gradient hooks would never repeat; the memoized specs' next states do not depend
        on the task (only ``count-once-per-phase``, left out, keeps tasks; ``epilogue-once`` names one in a
        message, and failing transitions are not memoized) -- checked by test_watch."""
        key = (ev.kind, ev.param, ev.module, ev.value, ev.phase, ev.note)
        twin = self._twins.get(key)
        if twin is None:
            twin = self._twins[key] = Event(ev.kind, ev.param, ev.module, None, ev.value, ev.phase, ev.note)
        return twin

    def _intern(self) -> int | None:
        """The id of the current product state (None: the memo is off -- an unhashable state)."""
        if self._memo is None:
            return None
        state = self.state
        prod = tuple(state[sid] for sid in self._memo_ids)
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
            pid = self._pids[prod] = self._next_pid  # never reused: an entry filed under a cleared id stays unmatched
            self._next_pid += 1
        return pid

    # ------------------------------------------------------------ feeding
    def _record(self, ev: Event) -> int:
        """Number the event, add it to the violations still collecting the events after them, and to the
        recent window; returns its index."""
        i = self.index
        self.index = i + 1
        if self._filling:
            for rec in list(self._filling):
                rec["events"].append((i, str(ev)))
                rec["_after"] -= 1
                if rec["_after"] <= 0:
                    self._filling.remove(rec)
        self.recent.append((i, ev))
        return i

    def feed(self, ev: Event | dict[str, Any]) -> None:
        """Fold one event (an `Event` or its dict)."""
        if ev.__class__ is not Event:
            ev = Event.from_dict(ev)
        self.feed_many(collections.deque((ev,)))

    def feed_many(self, queue: collections.deque) -> None:
        """Fold the `Event` s of ``queue``, taking them from its left until it is empty (one at a time: an
        exception -- Ctrl-C -- inside a step leaves the events after it queued).  The memo's hits are folded
        here; every other event by `_fold`."""
        pop = queue.popleft
        state, failing, direct, recent = self.state, self._failing, self._direct, self.recent
        while queue:
            ev = pop()
            if self._filling:
                i = self._record(ev)
            else:  # `_record`, inlined: no violation is collecting the events after it
                i = self.index
                self.index = i + 1
                recent.append((i, ev))
            k = ev.kind
            pid = self._pid
            key_ev = ev if ev.task is None else self._task_free(ev)
            if not failing and pid is not None:
                hit = self._memo.get((pid, id(key_ev)))
                if hit is not None and hit[0] is key_ev:  # this product state has seen this event: no spec fails
                    self._pid = hit[1]
                    for sid, m in hit[2]:
                        state[sid] = m
                    for sid, step in direct[k]:
                        m = step(state[sid], ev)
                        if m.__class__ is _FAILURE:
                            self._violated(sid, m.message, i)
                            failing[sid] = m.message
                        else:
                            state[sid] = m
                    if k in _MEMORY_KINDS or self.steps <= SERIES_STEP:
                        self._memory(i, ev)
                    continue
            self._fold(ev, i, key_ev)

    def _fold(self, ev: Event, i: int, key_ev: Event) -> None:
        """Event ``i`` spec by spec (a memo miss, or a check is failing); files the transition in the memo
        when no memoized spec fails or was failing."""
        state = self.state
        failing = self._failing
        k = ev.kind
        pid = self._pid
        memo = pid is not None and not failing
        if memo:
            self._misses += 1
            before = [state[sid] for sid in self._memo_ids]
        if failing:  # a spec that ignores this kind passes it: it is no longer failing (as in the full fold)
            reacting = self._ids_by_kind[k]
            for sid in [sid for sid in failing if sid not in reacting]:
                del failing[sid]
        for sid, step in self._by_kind[k]:
            m = step(state[sid], ev)
            if m.__class__ is _FAILURE:
                # keep the state before the failing event, so the check goes on in step with DeepSpeed
                if failing.get(sid) != m.message:
                    self._violated(sid, m.message, i)
                failing[sid] = m.message
                if sid not in UNMEMOIZED:
                    memo = False
                continue
            if failing:
                failing.pop(sid, None)
            state[sid] = m
        if self._memo is not None:
            new = self._pid = self._intern()
            if memo and new is not None:  # no memoized spec failed, none was failing: file the transition
                changed = tuple((sid, state[sid]) for sid, old in zip(self._memo_ids, before) if state[sid] is not old)
                self._memo[(pid, id(key_ev))] = (key_ev, new, changed)
        if k in _MEMORY_KINDS or self.steps <= SERIES_STEP:
            self._memory(i, ev)

    def finish(self) -> None:
        """The end of the job: the obligations still open (a backward whose epilogue never ran...)."""
        for s in self.specs:
            msg = s.finish(self.state[s.id])
            if msg:  # a `Failure` or a bare message
                self._violated(s.id, getattr(msg, "message", msg), None)
            self.state[s.id] = s.init()
        self._pid = self._intern()

    def _violated(self, spec: str, message: str, i: int | None) -> None:
        key = (spec, message)
        if key in self._seen:
            self._seen[key]["count"] += 1
            return
        if sum(1 for v in self.violations if v["spec"] == spec) >= KEEP:
            return
        events = [(j, str(e)) for j, e in self.recent]
        rec = {"spec": spec, "message": message, "event": i, "step": self.steps, "backward": self.backwards,
               "count": 1, "events": events, "_after": AROUND if i is not None else 0,
               "modules": _names(self.recent, "module"), "params": _names(self.recent, "param", message)}
        self._seen[key] = rec
        self.violations.append(rec)
        if i is not None:
            self._filling.append(rec)
        if self.on_violation is not None:
            self.on_violation(rec)

    # ------------------------------------------------------------ memory
    def _memory(self, i: int, ev: Event) -> None:
        k = ev.kind
        if k is EventKind.USER_BACKWARD_START:
            self.backwards += 1
            self._peak = self.total
        elif k is EventKind.USER_BACKWARD_END and self._peak is not None:
            self.peaks.append(self._peak)
            self._peak = None
        elif k is EventKind.STEP:
            self.allgathers.append(self._ag)
            self._ag = 0
            if self.steps <= SERIES_STEP:
                self.series = self._series_now
            self._series_now = []
            self.steps += 1
        if k in (EventKind.FETCH, EventKind.PREFETCH):
            if ev.note != "watch-start" and (k is EventKind.PREFETCH or ev.note != "inflight"):
                self._ag += 1  # (watch-start: gathered before watching began, `WatchTracer._report_gathered`)
            if ev.param not in self.gathered:
                self.gathered.add(ev.param)
                self.total += self.numel(ev.param)
        elif k is EventKind.RELEASE and ev.param in self.gathered:
            self.gathered.discard(ev.param)
            self.total -= self.numel(ev.param)
        if self._peak is not None:
            self._peak = max(self._peak, self.total)
        if self.steps <= SERIES_STEP and (k in (EventKind.FETCH, EventKind.PREFETCH, EventKind.RELEASE, EventKind.FORWARD_START,
                                                  EventKind.USER_BACKWARD_START, EventKind.STEP, EventKind.RECOMPUTE_START)):
            self._series_now.append((i, self.total, k.value))

    def memory(self) -> dict[str, Any]:
        return {"gathered_now": self.total, "gathered_peak_per_backward": self.peaks[-200:],
                "gathered_peak": max(self.peaks, default=self._peak or 0),
                "allgathers_per_step": self.allgathers[-200:],
                "series_step": min(SERIES_STEP, max(self.steps - 1, 0)) if self.series else None,
                "series": self.series or self._series_now}

    def to_dict(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in rec.items() if not k.startswith("_")} for rec in self.violations]


def watch_specs(params_of: Callable[[str], tuple], stage: int = 3) -> list[Spec]:
    """Every spec, ``available-when-used`` reading the user's model: what a module computes with is
    ``params_of(module)`` (its own parameters, every parameter under a z3 leaf module -- what ZeRO-3 fetches
    for it), not zerostate's network naming, and a checkpoint may wrap any of a module's ancestors
    (`zerostate.specs.coordinator_specs.ancestor_regions`).

    ZeRO-1/2 (``stage`` < 3) have no parameter coordinator: the tracer emits none of the events a coordinator
    spec can fail on (FETCH / PREFETCH / RELEASE / HOLDERS / TRACE_STATE / module hooks / UNPACK), so those
    specs could only pass -- the hook specs alone are folded."""
    if stage != 3:
        return [s for s in SPECS.values() if s.family == "hooks"]
    return [available_when_used(params_of, ancestor_regions) if s.id == "available-when-used" else s
            for s in SPECS.values()]


def _names(recent, field: str, message: str = "") -> list[str]:
    """Module / parameter names in the events before a violation (the user's names), most recent first."""
    out: list[str] = []
    for _, ev in reversed(recent):
        n = getattr(ev, field)
        if n and n not in out:
            out.append(n)
        if len(out) >= 8:
            break
    if message:
        out.sort(key=lambda n: n not in message)
    return out


__all__ = ["AROUND", "BEFORE", "OnlineChecker", "watch_specs"]
