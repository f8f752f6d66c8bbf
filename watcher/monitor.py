"""Check every spec online, one event at a time, and measure ZeRO-3 memory as the job runs.

`OnlineChecker.feed(event)` folds the event into each spec's monitor with the one fold
(`zerostate.model.fold`, the fold `check_trace` and the model checker use; no oracle).  A monitor that fails
records a violation -- a `Finding` keyed by spec + code, its message, the events before it and the next
``AROUND`` after it, train step and backward number -- and keeps its state from before the failing event, so the
job keeps being checked in step with DeepSpeed.  A violation with the same key is counted (its first few
distinct messages kept), not stored again; a check that keeps failing with the same message event after event
counts once.

Memory (ZeRO-3): parameter elements gathered (AVAILABLE or INFLIGHT, from FETCH / PREFETCH / RELEASE)
-- the peak per user backward -- and all-gathers per train step (PREFETCH, and FETCH that did not wait on
a prefetch), as `zerostate.specs.coordinator_specs.gathered_peak` / ``allgathers`` count them; plus the
gathered-elements series of one train step (the second, whose trace is complete; the first if the job
has one step) for the picture.
"""

from __future__ import annotations

import collections
from typing import Any
from collections.abc import Callable, Iterable

from zerostate.findings.finding import Finding
from zerostate.model.events import EventKind, Event
from zerostate.model.fold import Fold
from zerostate.model.failure import Failure
from zerostate.specs import SPECS
from zerostate.specs.base import Spec
from zerostate.specs.coordinator_specs import ancestor_regions, available_when_used

BEFORE = 120
"""Events kept before a violation (the trace picture's window)."""
AROUND = 8
"""Events kept after it."""
KEEP = 50
"""Distinct violations kept per spec (more are only counted)."""
SERIES_STEP = 1
UNMEMOIZED = frozenset({"count-once-per-phase", "count-matches-hooks"})
"""Specs the transition memo leaves out (`OnlineChecker.feed`): their state holds graph task ids, new every
backward, so product states holding it would never repeat.  (Leaving a spec out is only slower, never wrong.)"""
MESSAGES = 5
"""Distinct messages kept per finding (a violation's key is spec + code; its messages name the parameters)."""
_MEMORY_KINDS = frozenset({EventKind.USER_BACKWARD_START, EventKind.USER_BACKWARD_END, EventKind.STEP, EventKind.FETCH,
                           EventKind.PREFETCH, EventKind.RELEASE})
"""The kinds `OnlineChecker._memory` counts with (the others only extend a peak or the series)."""
_SERIES_KINDS = frozenset({EventKind.FETCH, EventKind.PREFETCH, EventKind.RELEASE, EventKind.FORWARD_START,
                           EventKind.USER_BACKWARD_START, EventKind.STEP, EventKind.RECOMPUTE_START})
"""The kinds a point of the memory series is drawn at."""
EVIDENCE_MAX = 200_000
"""Events the evidence window holds at most (`OnlineChecker.evidence`; normally two train steps' worth)."""
_STICKY = frozenset({EventKind.PERSISTENT, EventKind.REREGISTER, EventKind.ROLE, EventKind.GRADIENTS_UNOBSERVED})
"""Kinds a known issue's rule or a fingerprint reads from anywhere before a finding (the persistent parameters,
hooks registered again, the gradients the tracer cannot see): kept when the window moves past them."""
_STICKY_MAX = 20_000


class OnlineChecker:
    """Every spec folded online by the one fold (`zerostate.model.fold.Fold`: dispatch by kind, the transition memo,
    a failing spec keeps its state from before the failing event and goes on), plus what the watch keeps of each
    violation -- a `Finding` keyed by spec + code, with the events around it, train step and backward -- and the
    memory figures.  test_watch compares it with folding every spec over every event."""

    def __init__(self, numel: Callable[[str], int], specs: Iterable[Spec] | None = None,
                 on_violation: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.fold = Fold(specs or SPECS.values(), on_failure=self._failed, memo=True, unmemoized=UNMEMOIZED)
        self.numel = numel
        self.on_violation = on_violation
        self.recent: collections.deque = collections.deque(maxlen=BEFORE)
        self.violations: list[dict[str, Any]] = []
        self._seen: dict[str, dict[str, Any]] = {}
        """`Finding.key` (spec:code) -> its record."""
        self._filling: list[dict[str, Any]] = []
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
        self.kinds: set[EventKind] = set()
        """Every event kind folded so far (which specs an event exercised: `zerostate.watcher.observed`)."""
        self._window: list[Event] = []
        """The events of the train step before this one and of this one so far (the evidence of a finding)."""
        self._window_base = 0
        """The index of ``_window[0]``."""
        self._step_start = 0
        """The index of the first event of the current train step."""
        self._sticky: list[tuple[int, Event]] = []

    # ------------------------------------------------------------ feeding
    @property
    def events_seen(self) -> int:
        return self.fold.index

    @property
    def specs(self) -> list[Spec]:
        return self.fold.specs  # type: ignore[return-value]

    @property
    def state(self) -> dict[str, Any]:
        return self.fold.state

    def set_specs(self, specs: Iterable[Spec]) -> None:
        """Check ``specs`` from now on (from their initial states)."""
        self.fold.set_specs(specs)

    def restart(self, spec_id: str) -> None:
        """Start ``spec_id``'s monitor again from its initial state (the tracer has just synchronised with what
        it observes: `zerostate.tracing.core.TraceCore.poll_trace`)."""
        self.fold.restart(spec_id)

    def _record(self, i: int, ev: Event) -> None:
        """Before event ``i`` is folded: add it to the violations still collecting the events after them, to
        the recent window (a violation at it shows it) and to the evidence window."""
        w = self._window
        w.append(ev)
        if len(w) > EVIDENCE_MAX:  # a step longer than that (or a job that never steps): keep its later half
            del w[:EVIDENCE_MAX // 2]
            self._window_base += EVIDENCE_MAX // 2
        k = ev.kind
        if k not in self.kinds:
            self.kinds.add(k)
        if k in _STICKY and len(self._sticky) < _STICKY_MAX:
            self._sticky.append((i, ev))
        if self._filling:
            for rec in list(self._filling):
                rec["events"].append((i, str(ev)))
                rec["_after"] -= 1
                if rec["_after"] <= 0:
                    self._filling.remove(rec)
        self.recent.append((i, ev))

    def _after(self, i: int, ev: Event) -> None:
        if ev.kind in _MEMORY_KINDS or self.steps <= SERIES_STEP:
            self._memory(i, ev)

    def feed(self, ev: Event | dict[str, Any]) -> None:
        """Fold one event (an `Event` or its dict)."""
        if ev.__class__ is not Event:
            ev = Event.from_dict(ev)  # type: ignore[arg-type]
        self.feed_many(collections.deque((ev,)))  # type: ignore[arg-type]

    def feed_many(self, queue: collections.deque) -> None:
        """Fold the `Event` s of ``queue``, taking them from its left until it is empty."""
        self.fold.feed_many(queue, self._record, self._after)

    def finish(self) -> None:
        """The end of the job: the obligations still open (a backward whose epilogue never ran...)."""
        self.fold.finish()

    def _failed(self, spec: str, failure: Failure, i: int | None) -> None:
        """A new violation of ``spec`` at event ``i`` (None: at the end).  One record per `Finding.key` (spec +
        code): the same violation again is counted, and its first few distinct messages kept."""
        finding = Finding(check=spec, error=failure.message, scenario=None, code=failure.code)  # type: ignore[arg-type]
        key = finding.key
        rec = self._seen.get(key)
        if rec is not None:
            rec["count"] += 1
            if failure.message not in rec["messages"] and len(rec["messages"]) < MESSAGES:
                rec["messages"].append(failure.message)
            return
        if sum(1 for v in self.violations if v["spec"] == spec) >= KEEP:
            return
        events = [(j, str(e)) for j, e in self.recent]
        rec = {"spec": spec, "code": failure.code, "key": key, "message": failure.message,
               "messages": [failure.message], "event": i, "step": self.steps, "backward": self.backwards,
               "count": 1, "events": events, "_after": AROUND if i is not None else 0,
               "modules": _names(self.recent, "module"), "params": _names(self.recent, "param", failure.message),
               "_finding": finding}
        self._seen[key] = rec
        self.violations.append(rec)
        if i is not None:
            self._filling.append(rec)
        if self.on_violation is not None:
            self.on_violation(rec)

    def findings(self) -> list[Finding]:
        """The violations as `Finding` s (one per key, the first message)."""
        return [rec["_finding"] for rec in self.violations]

    def evidence(self, i: int | None) -> tuple[tuple[Event, ...], int | None]:
        """(the events a finding at event ``i`` rests on, ``i``'s index among them): the events of the train step
        before and of the current one up to now, after the persistent-parameter and re-registration events from
        before them (what a known issue's rule reads, `zerostate.known.mechanism`).  ``i`` None (an obligation
        open at the end, an exception): index None."""
        base = self._window_base
        before = [ev for j, ev in self._sticky if j < base]
        trace = (*before, *self._window)
        if i is None or i < base:
            return trace, None
        return trace, len(before) + i - base

    def _move_window(self, i: int) -> None:
        """At the STEP event ``i``: the window keeps the train step it ends and moves on."""
        drop = self._step_start - self._window_base
        if drop > 0:
            del self._window[:drop]
            self._window_base = self._step_start
        self._step_start = i + 1

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
            self._move_window(i)
            self.allgathers.append(self._ag)
            self._ag = 0
            if self.steps <= SERIES_STEP:
                self.series = self._series_now
            self._series_now = []
            self.steps += 1
        if k in (EventKind.FETCH, EventKind.PREFETCH):
            if ev.note != "watch-start" and (k is EventKind.PREFETCH or ev.note != "inflight"):
                self._ag += 1  # (watch-start: gathered before watching began, `WatchTracer._report_gathered`)
            if ev.param is not None and ev.param not in self.gathered:
                self.gathered.add(ev.param)
                self.total += self.numel(ev.param)
        elif k is EventKind.RELEASE and ev.param in self.gathered:
            self.gathered.discard(ev.param)
            self.total -= self.numel(ev.param)
        if self._peak is not None:
            self._peak = max(self._peak, self.total)
        if self.steps <= SERIES_STEP and k in _SERIES_KINDS:
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


def _names(recent: collections.deque[tuple[int, Event]], field: str, message: str = "") -> list[str]:
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
