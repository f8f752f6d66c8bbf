"""Ray, imported on demand: the one place that says it is missing, and the loopback set-up of a local cluster."""

from __future__ import annotations

import os
from types import ModuleType

EXTRA = "zerostate[cluster]"

LOOPBACK = "127.0.0.1"

LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
"""For a cluster on this machine: Ray resolves a loopback node address to the machine's outward address
unless it is in its single-machine mode (read once, when ray is imported), and every node, worker and
driver of a local cluster must stay on the loopback address."""


class ClusterUnavailable(RuntimeError):
    """Ray is not installed (the ``cluster`` extra), or the cluster cannot be reached or used."""


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host in ("127.0.0.1", "localhost", "::1", "[::1]") or host.startswith("127.")


def require_ray(local: bool) -> ModuleType:
    """``ray``, imported; `ClusterUnavailable` naming the extra when it is not installed.  ``local``: the
    cluster is on this machine (its loopback address), which must be said before ray is first imported."""
    if local:
        for k, v in LOCAL_ENV.items():
            os.environ.setdefault(k, v)
    try:
        import ray
    except ImportError:
        raise ClusterUnavailable(f"--cluster needs Ray, which is not installed: pip install '{EXTRA}'") from None
    return ray


__all__ = ["EXTRA", "LOCAL_ENV", "LOOPBACK", "ClusterUnavailable", "is_loopback", "require_ray"]
