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
from typing import Any, Callable, NamedTuple

from zerostate.model.events import DRIVER_EVENTS, Ev, Event
from zerostate.specs import SPECS
from zerostate.specs.base import Spec, fail
from zerostate.specs.coordinator_specs import _RECOMPUTE_PARTS, _STATUS, _status, _used_fail

_FAILURE = type(fail("-"))
"""What a monitor step returns on a violation (`zerostate.specs.base.fail`); compared by class, per event."""

BEFORE = 120
"""Events kept before a violation (the trace picture's window)."""
AROUND = 8
"""Events kept after it."""
KEEP = 50
"""Distinct violations kept per spec (more are only counted)."""
SERIES_STEP = 1


def available_when_used(params_of: Callable[[str], tuple]) -> Spec:
    """``available-when-used`` for a user's model: what a module computes with is ``params_of(module)`` (its
    own parameters, every parameter under a z3 leaf module -- what ZeRO-3 fetches for it), not zerostate's
    network naming (`zerostate.model.network.params_of_module`, which would misread a user's ``blocks.0``).
    A module recomputed by a non-reentrant checkpoint (between RECOMPUTE_START and RECOMPUTE_END) is not
    judged at its backward: it reads the tensors the recompute saved, as in the spec's own exception."""
    base = SPECS["available-when-used"]

    class _St(NamedTuple):
        avail: frozenset = frozenset()
        inflight: frozenset = frozenset()
        fwd: tuple | None = None
        bwd: str | None = None
        recomputed: frozenset = frozenset()
        in_recompute: int = 0

    def missing(module: str, avail: frozenset) -> list[str]:
        return [p for p in params_of(module) if p not in avail]

    def step(m: _St, ev: Event):
        k = ev.kind
        if k in _STATUS:
            a, i = _status(m.avail, m.inflight, ev)
            return m._replace(avail=a, inflight=i)
        if k not in DRIVER_EVENTS:
            return m
        if m.fwd is not None:
            miss = missing(m.fwd[0], m.avail)
            if miss:
                return _used_fail(m.fwd[0], m.fwd[1] or "forward", miss)
            m = m._replace(fwd=None)
        if m.bwd is not None and k not in _RECOMPUTE_PARTS:
            if m.bwd not in m.recomputed:
                miss = missing(m.bwd, m.avail)
                if miss:
                    return _used_fail(m.bwd, "backward", miss)
            m = m._replace(bwd=None)
        if k is Ev.USER_BACKWARD_START:
            return m._replace(recomputed=frozenset(), in_recompute=0)
        if k is Ev.RECOMPUTE_START:
            return m._replace(in_recompute=m.in_recompute + 1)
        if k is Ev.RECOMPUTE_END:
            return m._replace(in_recompute=max(0, m.in_recompute - 1))
        if k is Ev.MODULE_PRE_FORWARD:
            rec = m.recomputed | {ev.module} if m.in_recompute else m.recomputed
            return m._replace(fwd=(ev.module, ev.phase), recomputed=rec)
        if k is Ev.MODULE_PRE_BACKWARD:
            return m._replace(bwd=ev.module)
        if k is Ev.MODULE_POST_BACKWARD and ev.module not in m.recomputed:
            miss = missing(ev.module, m.avail)
            if miss:
                return _used_fail(ev.module, "backward", miss)
        return m

    return Spec(id=base.id, sentence=base.sentence, provenance=base.provenance, family=base.family,
                init=_St, step=step, finish=lambda m: None, checks=base.checks)


class OnlineChecker:
    def __init__(self, numel: Callable[[str], int], specs=None, on_violation=None):
        self.specs = list(specs or SPECS.values())
        self.state = {s.id: s.init() for s in self.specs}
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
        self.events_seen = 0

    # ------------------------------------------------------------ feeding
    def feed(self, d: dict[str, Any]) -> None:
        ev = Event.from_dict(d)
        i = self.index
        self.index += 1
        self.events_seen += 1
        if self._filling:
            for rec in list(self._filling):
                rec["events"].append((i, str(ev)))
                rec["_after"] -= 1
                if rec["_after"] <= 0:
                    self._filling.remove(rec)
        self.recent.append((i, ev))
        state = self.state
        for s in self.specs:
            m = s.step(state[s.id], ev)
            if m.__class__ is _FAILURE:
                # keep the state before the failing event, so the check goes on in step with DeepSpeed
                if self._failing.get(s.id) != m.message:
                    self._violated(s.id, m.message, i)
                self._failing[s.id] = m.message
                continue
            if self._failing:
                self._failing.pop(s.id, None)
            state[s.id] = m
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
        if k is Ev.USER_BACKWARD_START:
            self.backwards += 1
            self._peak = self.total
        elif k is Ev.USER_BACKWARD_END and self._peak is not None:
            self.peaks.append(self._peak)
            self._peak = None
        elif k is Ev.STEP:
            self.allgathers.append(self._ag)
            self._ag = 0
            if self.steps <= SERIES_STEP:
                self.series = self._series_now
            self._series_now = []
            self.steps += 1
        if k in (Ev.FETCH, Ev.PREFETCH):
            if k is Ev.PREFETCH or ev.note != "inflight":
                self._ag += 1
            if ev.param not in self.gathered:
                self.gathered.add(ev.param)
                self.total += self.numel(ev.param)
        elif k is Ev.RELEASE and ev.param in self.gathered:
            self.gathered.discard(ev.param)
            self.total -= self.numel(ev.param)
        if self._peak is not None:
            self._peak = max(self._peak, self.total)
        if self.steps <= SERIES_STEP and (k in (Ev.FETCH, Ev.PREFETCH, Ev.RELEASE, Ev.FORWARD_START,
                                                  Ev.USER_BACKWARD_START, Ev.STEP, Ev.RECOMPUTE_START)):
            self._series_now.append((i, self.total, k.value))

    def memory(self) -> dict[str, Any]:
        return {"gathered_now": self.total, "gathered_peak_per_backward": self.peaks[-200:],
                "gathered_peak": max(self.peaks, default=self._peak or 0),
                "allgathers_per_step": self.allgathers[-200:],
                "series_step": min(SERIES_STEP, max(self.steps - 1, 0)) if self.series else None,
                "series": self.series or self._series_now}

    def to_dict(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in rec.items() if not k.startswith("_")} for rec in self.violations]


def watch_specs(params_of: Callable[[str], tuple]) -> list[Spec]:
    """Every spec, with ``available-when-used`` reading the user's model (`available_when_used`)."""
    return [available_when_used(params_of) if s.id == "available-when-used" else s for s in SPECS.values()]


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


__all__ = ["AROUND", "BEFORE", "OnlineChecker", "available_when_used", "watch_specs"]
