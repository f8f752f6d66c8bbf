"""`ClusterSession`: this process connected to a Ray cluster, making exploration workers on it.

::

    with ClusterSession("127.0.0.1:6379", kind="deepspeed", options={"deepspeed": "0.19.8"}, gang=2) as s:
        target = s.target()                       # a remote.RemoteTarget
        explore(target, examples=200, jobs=s.lanes, spawn=s.target)
        s.retries                                  # every lane run again, and why

A worker's *gang* is the most ranks one of its scenarios may ask for: its placement group is one bundle
of that many CPUs (and GPUs, on a GPU node), so the worker and the rank pool of any of its scenarios run
together on one node, each rank pool with its own process group.  `lanes` is how many such gangs the
cluster's nodes hold at once: the default number of workers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from types import TracebackType
from typing import Any

from zerostate.cluster.host import LaneHost, TargetSpec
from zerostate.cluster.ray_api import ClusterUnavailable, is_loopback, require_ray
from zerostate.cluster.remote import RemoteTarget, Retry

PLACEMENT_TIMEOUT = 600.0
"""Seconds a worker's placement group may wait for room on some node before the run stops, loudly."""

STARTUP_TIMEOUT = 1200.0
"""Seconds a worker may take to start (a release's first use on a node installs it and builds its op)."""

_PASSED_ENV = ("ZEROSTATE_", "DS_", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TORCH_")


def passed_env() -> dict[str, str]:
    """The settings of this process a worker on another node must see (example timeout, cache, DeepSpeed's)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV)}


def _node_line(n: dict[str, Any]) -> str:
    res = n["Resources"]
    gpus = f", {int(res['GPU'])} GPU" if res.get("GPU") else ""
    return f"{n['NodeID'][:8]} ({int(res.get('CPU', 0))} CPU{gpus})"


class ClusterSession:
    """Connected to the Ray cluster at ``address``; makes workers of one target kind and options."""

    def __init__(self, address: str, *, kind: str, options: dict[str, Any], gang: int = 1,
                 startup_timeout: float = STARTUP_TIMEOUT):
        self.address = address
        self.ray = require_ray(is_loopback(address))
        self.spec: TargetSpec = {"kind": kind, "options": dict(options), "gang": max(1, gang), "env": passed_env()}
        self.gang = max(1, gang)
        self.startup_timeout = startup_timeout
        self.retries: list[Retry] = []
        self._lock = threading.Lock()
        self._made = 0
        self._connected_here = False
        if not self.ray.is_initialized():
            try:
                self.ray.init(address=address, namespace="zerostate", log_to_driver=False, logging_level="ERROR",
                              configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ClusterUnavailable(f"--cluster {address}: cannot connect to a Ray cluster there "
                                         f"({str(exc).strip().splitlines()[0] if str(exc).strip() else exc})") from None
            self._connected_here = True
        from ray import exceptions as rex
        self.lost_errors: tuple[type[BaseException], ...] = (
            rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError, rex.OwnerDiedError)
        self._host_cls = self.ray.remote(LaneHost)
        self.gpus = 1 if self._cluster_gpus() else 0
        if self.lanes < 1:
            raise ClusterUnavailable(f"--cluster {address}: no node has {self.gang} CPU(s)"
                                     f"{' and GPU(s)' if self.gpus else ''} for a worker whose scenarios may run "
                                     f"{self.gang} ranks together (nodes: {self.describe_nodes()})")

    # ------------------------------------------------------------ the cluster
    def nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def _cluster_gpus(self) -> bool:
        return any(n["Resources"].get("GPU", 0) >= self.gang for n in self.nodes())

    @property
    def lanes(self) -> int:
        """How many workers (gangs) the live nodes hold at once."""
        nodes = self.nodes()
        per = [int(n["Resources"].get("CPU", 0) // self.gang) for n in nodes]
        if self.gpus:
            per = [min(c, int(n["Resources"].get("GPU", 0) // self.gang)) for c, n in zip(per, nodes, strict=True)]
        return sum(per)

    def describe_nodes(self) -> str:
        return ", ".join(_node_line(n) for n in self.nodes()) or "none alive"

    # ------------------------------------------------------------ workers
    def target(self) -> RemoteTarget:
        """A new worker on the cluster (its placement group, its actor, its target started)."""
        with self._lock:
            index = self._made
            self._made += 1
        return RemoteTarget(self, index)

    def gang_group(self) -> Any:
        from ray.util.placement_group import placement_group
        bundle = {"CPU": float(self.gang), **({"GPU": float(self.gang)} if self.gpus else {})}
        pg = placement_group([bundle], strategy="STRICT_PACK")
        try:
            self.ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT)
        except self.ray.exceptions.GetTimeoutError:
            self.remove_group(pg)
            raise ClusterUnavailable(f"--cluster {self.address}: no room for a worker of {self.gang} CPU(s) within "
                                     f"{PLACEMENT_TIMEOUT:.0f} s (nodes: {self.describe_nodes()}); ask for fewer "
                                     "--jobs") from None
        return pg

    def remove_group(self, pg: Any) -> None:
        from ray.util.placement_group import remove_placement_group
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 -- a group of a cluster that is gone is removed with it
            return

    def new_host(self, pg: Any) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return self._host_cls.options(
            num_cpus=self.gang, num_gpus=self.gang if self.gpus else 0, max_restarts=0, max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0),
        ).remote(self.spec)

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        """``ray.get``, with an exception raised inside the worker re-raised as itself."""
        try:
            return self.ray.get(ref, timeout=timeout)
        except self.ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, BaseException):
                raise cause from None
            raise

    def forget(self, actor: Any, graceful: bool = False) -> None:
        """End a worker's actor (``graceful``: its target closed first, so no process of it stays)."""
        if actor is None:
            return
        if graceful:
            with contextlib.suppress(Exception):  # an actor that cannot close is killed below
                self.ray.get(actor.close.remote(), timeout=60)
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 -- already gone with its node
            return

    def note_retry(self, r: Retry) -> None:
        with self._lock:
            self.retries.append(r)

    def close(self) -> None:
        if self._connected_here and self.ray.is_initialized():
            self.ray.shutdown()
            self._connected_here = False

    def __enter__(self) -> ClusterSession:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


__all__ = ["ClusterSession", "PLACEMENT_TIMEOUT", "STARTUP_TIMEOUT", "passed_env"]
