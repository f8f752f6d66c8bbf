"""A Ray cluster on this machine: one head node and worker nodes, each a process tree of its own.

::

    with LocalCluster(nodes=2, cpus_per_node=2) as c:   # two nodes, each declaring 2 logical CPUs
        run(..., cluster=c.address)                      # "127.0.0.1:PORT"
        c.kill_node(1)                                   # a node's crash: its raylet and its workers

Every node is `node`'s process, started in a session of its own and stopped (SIGTERM, then SIGKILL of its
process group) by its own process id; a node also stops when its parent process is gone, so no node
outlives the command or test that started it.  Everything listens on the loopback address.

`auto` is ``--cluster auto``: join the local cluster another zerostate command recorded as running
(`record`), else start a one-node cluster with this machine's CPUs for the length of the command.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from zerostate.harness import envs
from zerostate.harness.rank_pool import free_port
from zerostate.cluster.ray_api import LOCAL_ENV, LOOPBACK, ClusterUnavailable

START_TIMEOUT = 600.0
"""Seconds a node may take to come up (a loaded 2-core machine took tens of seconds for each)."""


@dataclass
class NodeProcess:
    """One node of a local cluster: its name (a custom resource of 1 on it), process and Ray node id."""

    name: str
    proc: subprocess.Popen[bytes]
    node_id: str
    log: Path


class LocalCluster:
    """``nodes`` Ray nodes on this machine (the first the head), each declaring ``cpus_per_node`` CPUs."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 2, gpus_per_node: int = 0, object_store_mb: int = 80,
                 temp_dir: str | None = None):
        if nodes < 1 or cpus_per_node < 1:
            raise ValueError("a local cluster needs at least one node and one CPU per node")
        self.count, self.cpus, self.gpus, self.store_mb = nodes, cpus_per_node, gpus_per_node, object_store_mb
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="zs-ray-")  # short: Ray's socket paths are bounded
        self.port = free_port()
        self.nodes: list[NodeProcess] = []

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> LocalCluster:
        try:
            self.nodes.append(self._start_node(0))
            starting = [self._spawn(i) for i in range(1, self.count)]  # the worker nodes start side by side
            self.nodes += [self._ready(*s) for s in starting]
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, i: int) -> tuple[str, subprocess.Popen[bytes], Path]:
        name = f"node{i}"
        log = Path(self.temp_dir) / f"{name}.log"
        cmd = [sys.executable, "-m", "zerostate.cluster.node", "--num-cpus", str(self.cpus),
               "--num-gpus", str(self.gpus), "--object-store-mb", str(self.store_mb), "--name", name,
               "--parent-pid", str(os.getpid())]
        cmd += ["--head", "--port", str(self.port), "--temp-dir", self.temp_dir] if i == 0 else \
            ["--address", self.address]
        with open(log, "ab") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **LOCAL_ENV}, cwd=str(envs.cache_root()),
                                    start_new_session=True)
        return name, proc, log

    def _start_node(self, i: int) -> NodeProcess:
        return self._ready(*self._spawn(i))

    def _ready(self, name: str, proc: subprocess.Popen[bytes], log: Path) -> NodeProcess:
        """Wait for the node's ready line."""
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT
        buf = b""
        try:
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or proc.poll() is not None:
                    _kill(proc)
                    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                    raise ClusterUnavailable(f"Ray node {name} did not start "
                                             f"({'exited' if proc.returncode is not None else 'timed out'}):\n{tail}")
                if sel.select(min(left, 1.0)):
                    chunk = os.read(proc.stdout.fileno(), 4096)
                    buf += chunk
        finally:
            sel.close()
        hello = json.loads(buf.split(b"\n", 1)[0])
        return NodeProcess(name, proc, str(hello["node_id"]), log)

    def node_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    def kill_node(self, i: int) -> None:
        """A node's crash: its process group (the raylet, its workers and their children) killed at once."""
        _kill(self.nodes[i].proc)

    def stop(self) -> None:
        """Stop every node, worker nodes first (each stops the processes it started), by process id."""
        for n in reversed(self.nodes):
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)
        for n in reversed(self.nodes):
            try:
                n.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            _kill(n.proc)
            if n.proc.stdout is not None:
                n.proc.stdout.close()
        self.nodes = []
        _forget(self)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the node and everything it started (same process group)
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------------- --cluster auto
def _record_path() -> Path:
    return envs.cache_root() / "cluster" / "local.json"


def record(c: LocalCluster) -> None:
    """Note ``c`` as this machine's running local cluster (``--cluster auto`` of another command joins it)."""
    path = _record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"address": c.address, "pid": c.nodes[0].proc.pid}))


def _forget(c: LocalCluster) -> None:
    path = _record_path()
    try:
        if json.loads(path.read_text()).get("address") == c.address:
            path.unlink()
    except (OSError, ValueError):
        return


def recorded() -> str | None:
    """The address of the local cluster a command recorded, while its head process lives."""
    try:
        rec = json.loads(_record_path().read_text())
        os.kill(int(rec["pid"]), 0)
        return str(rec["address"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def auto(cpus: int | None = None, min_cpus: int = 1) -> tuple[str, LocalCluster | None]:
    """``--cluster auto``: the recorded local cluster's address (joined, not owned), or a one-node cluster
    started now with this machine's CPUs (owned: the caller stops it), at least ``min_cpus`` of them declared:
    one worker's gang fits on a machine with fewer cores, its ranks sharing them as a local run's do."""
    address = recorded()
    if address is not None:
        return address, None
    c = LocalCluster(nodes=1, cpus_per_node=max(cpus or os.cpu_count() or 1, min_cpus)).start()
    record(c)
    return c.address, c


__all__ = ["LocalCluster", "NodeProcess", "auto", "record", "recorded"]
