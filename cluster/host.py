"""The Ray actor that hosts one exploration worker: a real target (a DeepSpeed worker, its rank pools) on one node.

`LaneHost` is a plain class; `session.ClusterSession` makes it a Ray actor (so importing this module needs
no Ray).  Its methods take and return what crosses the process boundary, typed: a `TargetSpec` in, a
`HostReady` and `RunReply` out.  Scenarios and outcomes travel as the `Scenario` and `Outcome` they are (Ray
pickles them): nothing to parse on either side.
"""

from __future__ import annotations

import os
import socket
from typing import Any, TypedDict

from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Target, TargetError, get_target


class TargetSpec(TypedDict):
    """Which target a host builds: ``kind`` and ``options`` as `targets.interface.get_target` takes them."""

    kind: str
    options: dict[str, Any]
    gang: int
    """The most ranks one of its scenarios may ask for: its rank pool of that size starts ahead."""
    env: dict[str, str]
    """The driver's zerostate and DeepSpeed settings (``ZEROSTATE_*``, ``DS_*``, ...) the target must see."""


class HostReady(TypedDict):
    """A host's answer to `LaneHost.start`: whether its target was built (else the one-line reason), what it
    runs, and where."""

    ok: bool
    error: str
    version: str | None
    design: str
    world_size: int
    pid: int
    node_id: str
    host: str


class RunReply(TypedDict):
    outcome: Outcome
    restarts: int
    """The target's restart count after the run (hangs, crashes, ranks out of step)."""


class LaneHost:
    """One worker of an exploration, on whatever node Ray placed it."""

    def __init__(self, spec: TargetSpec):
        self.spec = spec
        self.target: Target | None = None

    def start(self) -> HostReady:
        """Build the target (start its worker); ``ok`` False with the one-line reason when it cannot."""
        import ray
        os.environ.update(self.spec["env"])
        base: HostReady = {"ok": False, "error": "", "version": None, "design": "", "world_size": 1,
                           "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                           "host": socket.gethostname()}
        try:
            self.target = get_target(self.spec["kind"], **self.spec["options"])
        except TargetError as exc:
            return {**base, "error": str(exc).strip().splitlines()[0] if str(exc).strip() else "TargetError"}
        t = self.target
        if self.spec["gang"] > 1:
            t.prestart(self.spec["gang"])
        return {**base, "ok": True, "version": t.version, "design": t.design.name,
                "world_size": int(self.spec["options"].get("world_size", 1))}

    def run(self, scenario: Scenario) -> RunReply:
        assert self.target is not None, "start() first"
        out = self.target.run(scenario)
        return {"outcome": out, "restarts": self.target.restarts}

    def fresh(self) -> int:
        """A fresh worker, nothing carried over; the restart count after it (0: no target built)."""
        if self.target is None:
            return 0
        self.target.fresh()
        return self.target.restarts

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
            self.target = None


__all__ = ["HostReady", "LaneHost", "RunReply", "TargetSpec"]
