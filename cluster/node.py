"""One Ray node of a cluster on this machine, as a process of its own: ``python -m zerostate.cluster.node``.

::

    python -m zerostate.cluster.node --head --port 26379 --num-cpus 2 --name node0 --temp-dir DIR
    python -m zerostate.cluster.node --address 127.0.0.1:26379 --num-cpus 2 --name node1

Each is what ``ray start`` starts (a head: the cluster's control store and a raylet; a worker node: a
raylet), on the loopback address, and runs until SIGTERM, when it stops every process it started.  Not
``ray start`` itself: that one resolves a loopback address to the machine's outward address and refuses a
second node in the single-machine mode that prevents it, and it leaves its processes running after it
returns; here each node is one process tree that `local.LocalCluster` starts and stops by its own id.
It prints one JSON line when the node is up: ``{"ready": true, "address": ..., "node_id": ..., "pid": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from zerostate.cluster.ray_api import LOCAL_ENV, LOOPBACK


def _params(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"node_ip_address": LOOPBACK, "num_cpus": args.num_cpus, "num_gpus": args.num_gpus,
                          "object_store_memory": args.object_store_mb * 1024 * 1024,
                          "resources": {args.name: 1.0}, "include_dashboard": False,
                          "min_worker_port": 0, "max_worker_port": 0}
    if args.head:
        kw.update(gcs_server_port=args.port, temp_dir=args.temp_dir)
    else:
        kw.update(gcs_address=args.address, include_log_monitor=False, node_manager_port=0)
    return kw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerostate.cluster.node")
    p.add_argument("--head", action="store_true")
    p.add_argument("--port", type=int, default=0, help="the head's control-store port")
    p.add_argument("--address", help="a worker node: the head's HOST:PORT")
    p.add_argument("--num-cpus", type=int, required=True)
    p.add_argument("--num-gpus", type=int, default=0)
    p.add_argument("--object-store-mb", type=int, default=80)
    p.add_argument("--name", required=True, help="a custom resource naming this node (1 of it)")
    p.add_argument("--temp-dir", default=None)
    p.add_argument("--parent-pid", type=int, default=0, help="stop when this process is gone")
    args = p.parse_args(argv)
    for k, v in LOCAL_ENV.items():
        os.environ.setdefault(k, v)
    import ray._private.node as ray_node
    from ray._private.parameter import RayParams

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    node = ray_node.Node(RayParams(**_params(args)), head=args.head, shutdown_at_exit=True, spawn_reaper=True)
    try:
        print(json.dumps({"ready": True, "address": node.gcs_address, "node_id": node.node_id,
                          "pid": os.getpid()}), flush=True)
        while not stop.wait(1.0):
            if args.parent_pid and os.getppid() != args.parent_pid:  # the starter is gone
                break
    finally:
        node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
