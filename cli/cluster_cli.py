"""``--cluster ADDRESS|auto``: where ``explore`` runs its workers.

Without it nothing changes (local workers).  With it, each worker is a `cluster.remote.RemoteTarget` on
the Ray cluster at ADDRESS (``auto``: the local cluster another command started, else a one-node cluster
on this machine for the length of the command), and the explorer runs on them exactly as on local ones.
Ray is the optional extra ``zerostate[cluster]``: without it ``--cluster`` is one error line (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from zerostate.targets.interface import Target, TargetError

from zerostate.cli.common import CliError, design

WORLD_SIZE_DRAWN = 4
"""The most ranks a scenario of the default strategy asks for (`explorer.strategies._world_size`): a world-size-1
worker's gang on the cluster (its own rank pool runs that many ranks beside it)."""


def add_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="ADDRESS|auto", default=None,
                   help="run the workers on the Ray cluster at ADDRESS (HOST:PORT; 'auto': join the local one "
                        "or start one on this machine); the findings are those of the same command run "
                        "locally with --jobs N (needs the extra zerostate[cluster])")


class ClusterRun:
    """One command's use of a cluster: its session, the local cluster it started (if any), its retries."""

    def __init__(self, address: str, options: dict[str, Any], world_size: int, kind: str = "deepspeed"):
        from zerostate.cluster.ray_api import ClusterUnavailable
        self.owned: Any = None
        self.opened: Any = None
        """The session, once connected (closed by `close`)."""
        gang = 1 if kind == "model" else max(world_size, WORLD_SIZE_DRAWN)
        # Ray's driver prints a worker's death to sys.stdout from a thread of its own (listen_error_messages):
        # while a session is open stdout is stderr, so a --json command's output stays one JSON document.
        self._stdout: TextIO | None = sys.stdout if sys.stdout is not sys.stderr else None  # (the outermost)
        sys.stdout = sys.stderr
        try:
            if address == "auto":
                from zerostate.cluster.local import auto
                from zerostate.cluster.ray_api import require_ray
                require_ray(local=True)  # the missing extra is said before anything starts
                address, self.owned = auto(min_cpus=gang)
            from zerostate.cluster.session import ClusterSession
            self.opened = self.session = ClusterSession(address, kind=kind, options=options, gang=gang)
        except ClusterUnavailable as exc:
            self.close()
            raise CliError(str(exc)) from None
        except BaseException:
            self.close()
            raise
        self.address = address

    def target(self) -> Target:
        try:
            return self.session.target()
        except TargetError as exc:
            raise CliError(str(exc).strip().splitlines()[0]) from None
        except RuntimeError as exc:  # ClusterUnavailable: no room for a worker
            raise CliError(str(exc)) from None

    def jobs(self, asked: int | None) -> int:
        """``--jobs``, or as many workers as the cluster holds at once; never more than that."""
        room = self.session.lanes
        if asked is not None and asked > room:
            raise CliError(f"--jobs {asked}: the cluster at {self.address} holds {room} worker(s) at once "
                           f"({self.session.gang} CPU(s) each; nodes: {self.session.describe_nodes()})")
        return asked or room

    def describe(self) -> str:
        nodes = self.session.nodes()
        return (f"{self.address} ({len(nodes)} node(s), {self.session.lanes} worker(s) of "
                f"{self.session.gang} CPU(s) at once{'; started for this command' if self.owned else ''})")

    def retries(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.session.retries]

    def close(self) -> None:
        try:
            if self.opened is not None:
                self.opened.close()
                self.opened = None
            if self.owned is not None:
                self.owned.stop()
                self.owned = None
        finally:
            if self._stdout is not None:
                sys.stdout, self._stdout = self._stdout, None


def open_cluster(args: argparse.Namespace) -> ClusterRun | None:
    """The cluster ``--cluster`` names, connected (None without the option).  Bad input is said before any
    cluster is joined or started."""
    address = args.cluster
    if not address:
        return None
    if args.target == "model":  # a model design's workers on the cluster: the same lanes, nothing to install
        name = args.design or "zerostate"
        design(name)
        return ClusterRun(address, {"design": name}, world_size=1, kind="model")
    options = target_options(args)
    from zerostate.targets.deepspeed.kind import validate
    try:
        validate(**options)
    except TargetError as exc:
        raise CliError(str(exc)) from None
    if options.get("deepspeed"):
        from zerostate.cli.releases import check_requested
        check_requested(options["deepspeed"])
    return ClusterRun(address, options, int(args.world_size or 1))


def target_options(args: argparse.Namespace) -> dict[str, Any]:
    """The deepspeed target's options from the command line, as `targets.interface.get_target` takes them."""
    opts = {"deepspeed": args.deepspeed, "deepspeed_path": args.deepspeed_path, "design": args.design,
            "world_size": args.world_size}
    return {k: v for k, v in opts.items() if v is not None}


__all__ = ["ClusterRun", "WORLD_SIZE_DRAWN", "add_option", "open_cluster", "target_options"]
