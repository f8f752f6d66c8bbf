"""`RemoteTarget`: an exploration worker on a Ray cluster, driven by the explorer as it drives a local one.

It is a `Target` that can start afresh (``fresh()``) and counts ``restarts`` and ``examples``, so the explorer's
lanes, shrinking and confirmation run on it unchanged: each call goes to its `host.LaneHost` actor, in a placement
group of its own (`session.ClusterSession.gang_group`).

A lost worker is a fault of the cluster, not a result: when the actor (or its node) dies, a new actor is
started -- in the same placement group, which Ray places again elsewhere when the node itself is gone --
and the runs of the lane since its worker's last fresh start are run again in it, in order, before the run
that was lost.  So every scenario still runs after the same scenarios, and the outcomes the explorer gets
are those of an undisturbed lane.  Each recovery is a `Retry`, counted in the report.  The outcomes of the
runs run again are not handed on (the explorer has them); when one differs from the first (its finding
keys), the `Retry` says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerostate.model.designs import Design, get_design
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Target, TargetError

from zerostate.cluster.host import HostReady, RunReply

if TYPE_CHECKING:
    from zerostate.cluster.session import ClusterSession

MAX_RETRIES = 3
"""Recoveries of one run before the worker is given up (the target broke: the exploration stops, loudly)."""


@dataclass(frozen=True)
class Retry:
    """One lane run again because its worker was lost."""

    worker: int
    why: str
    """The cluster's error, one line."""
    node: str
    """The node the lost worker ran on."""
    replayed: int
    """Runs of the lane run again in the new worker before the lost one."""
    differed: tuple[str, ...] = ()
    """Runs run again whose finding keys differed from their first outcome (``scenario: was -> now``)."""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "why": self.why, "node": self.node, "replayed": self.replayed,
                "differed": list(self.differed), "seconds": round(self.seconds, 2)}


@dataclass
class _Lane:
    """The runs since the worker's last fresh start: what a new worker runs again before going on."""

    runs: list[tuple[Scenario, frozenset[str]]] = field(default_factory=list)

    def ran(self, scenario: Scenario, out: Outcome) -> None:
        self.runs.append((scenario, frozenset(f.key for f in out.findings)))

    def restart(self) -> None:
        self.runs = []


class RemoteTarget(Target):
    """One worker of an exploration on the cluster of ``session``."""

    can_refresh = True
    """`fresh` asks the host for a fresh worker (a lost one is replaced by a new one, as fresh)."""

    def __init__(self, session: ClusterSession, index: int):
        self.session = session
        self.index = index
        self.name = session.spec["kind"]
        self.examples = 0
        self.restarts = 0
        self.retries: list[Retry] = []
        self._lane = _Lane()
        self._group = session.gang_group()
        self._actor: Any = None
        self._host_restarts = 0
        self.node, self.pid = "?", 0
        """The node and process the worker runs on now (`_start`)."""
        try:
            try:
                self._start()
            except session.lost_errors as exc:  # lost while starting: a retry of a lane with no runs yet
                self._recover(exc)
        except BaseException:
            self.close()
            raise
        ready = self.ready
        self.version: str | None = ready["version"]
        self.design: Design = get_design(ready["design"])
        self.world_size = ready["world_size"]

    # ------------------------------------------------------------ the actor
    def _start(self) -> HostReady:
        self._actor = self.session.new_host(self._group)
        ready: HostReady = self.session.get(self._actor.start.remote(), self.session.startup_timeout)
        if not ready["ok"]:
            raise TargetError(ready["error"])
        self.node = ready["node_id"]
        self.pid = ready["pid"]
        self._host_restarts = 0
        self.ready = ready
        return ready

    def _recover(self, exc: BaseException) -> None:
        """The worker is lost: a new one, and the lane so far run again in it."""
        t0 = time.perf_counter()
        lost = self.node
        for _ in range(MAX_RETRIES):
            self.session.forget(self._actor)
            try:
                self._start()
                differed = [self._again(sc, keys) for sc, keys in self._lane.runs]
            except self.session.lost_errors as again:
                exc = again
                continue
            r = Retry(self.index, _one_line(exc), lost, len(self._lane.runs), tuple(d for d in differed if d),
                      time.perf_counter() - t0)
            self.retries.append(r)
            self.session.note_retry(r)
            return
        raise TargetError(f"cluster worker {self.index} was lost {MAX_RETRIES} times in one lane "
                          f"(last: {_one_line(exc)})") from None

    def _again(self, scenario: Scenario, keys: frozenset[str]) -> str:
        reply: RunReply = self.session.get(self._actor.run.remote(scenario))
        self._host_restarts = reply["restarts"]
        now = frozenset(f.key for f in reply["outcome"].findings)
        return "" if now == keys else f"{scenario.to_json(None)[:80]}: {sorted(keys)} -> {sorted(now)}"

    # ------------------------------------------------------------ the Target
    def run(self, scenario: Scenario) -> Outcome:
        self.examples += 1
        while True:
            try:
                reply: RunReply = self.session.get(self._actor.run.remote(scenario))
                break
            except self.session.lost_errors as exc:
                self._recover(exc)
        out = reply["outcome"]
        restarted = reply["restarts"] - self._host_restarts
        self._host_restarts = reply["restarts"]
        self.restarts += restarted
        if restarted:  # the worker restarted itself after this run: the lane goes on from a fresh start
            self._lane.restart()
        else:
            self._lane.ran(scenario, out)
        return out

    def fresh(self) -> None:
        while True:
            try:
                self._host_restarts = self.session.get(self._actor.fresh.remote(), self.session.startup_timeout)
                break
            except self.session.lost_errors as exc:
                self._lane.restart()  # a new worker is as fresh as asked for
                self._recover(exc)
                break
        self._lane.restart()

    def close(self) -> None:
        if self._actor is not None:
            self.session.forget(self._actor, graceful=True)
            self._actor = None
        if self._group is not None:
            self.session.remove_group(self._group)
            self._group = None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


__all__ = ["MAX_RETRIES", "RemoteTarget", "Retry"]
