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
_MEMORY_KINDS = frozenset({EventKind.USER_BACKWARD_START, EventKind.USER_BACKWARD_END, EventKind.STEP, EventKind.FETCH, EventKind.PREFETCH, EventKind.RELEASE})
"""The kinds `OnlineChecker._memory` counts with (the others only extend a peak or the series)."""


class OnlineChecker:
    """Every spec folded online.  ``feed`` hands each event only to the specs whose ``reacts_to`` holds its kind
    (for every other kind a spec's step returns its state unchanged, `zerostate.specs.base.Spec.reacts_to`):
    the same states and violations as folding every spec over every event (compared on model traces by
    test_watch), at a fraction of the cost -- HOLDERS, a third of a ZeRO-3 job's events,
    concerns one spec."""

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

    def restart(self, spec_id: str) -> None:
        """Start ``spec_id``'s monitor again from its initial state (the tracer has just synchronised with what
        it observes: `WatchTracer._poll_trace`)."""
        for s in self.specs:
            if s.id == spec_id:
                self.state[spec_id] = s.init()
                self._failing.pop(spec_id, None)

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
        if ev.__class__ is not Event:
            ev = Event.from_dict(ev)
        i = self._record(ev)
        state = self.state
        failing = self._failing
        k = ev.kind
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
                continue
            if failing:
                failing.pop(sid, None)
            state[sid] = m
        if k in _MEMORY_KINDS or self.steps <= SERIES_STEP:
            self._memory(i, ev)

    def finish(self) -> None:
        """The end of the job: the obligations still open (a backward whose epilogue never ran...)."""
        for s in self.specs:
            msg = s.finish(self.state[s.id])
            if msg:  # a `Failure` or a bare message
                self._violated(s.id, getattr(msg, "message", msg), None)
            self.state[s.id] = s.init()

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
