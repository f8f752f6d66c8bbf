"""``zerostate explore --deepspeed 0.18.4,0.19.2,0.19.8`` (or ``0.19.2..0.19.8``): a release matrix, one report.

``zerostate explore --target model --design ds-0.18.4,ds-0.18.5,ds-0.19.2`` is the same matrix over model
designs (each stands for the release it models: no DeepSpeed runs, so it is the fast form the tests use).
Each column (a release, or a design) is explored with the same examples (same seed and budget: the same
generated sequence) by its own ``zerostate explore`` into ``OUT/<column>/``; locally one after another, on a
cluster (``--cluster``) side by side.  Then every finding (by key, over all releases) gets a cell per release:

* **present** -- that release's exploration found it (the cell links its ``finding_<n>.json``), or, where
  the exploration did not meet it, its scenario replayed on that release shows it (``by replay``);
* **absent** -- its scenario, replayed on that release in a fresh worker, runs without it;
* **crashed before** -- the replay on that release raised, crashed or hung first (another finding's
  exception): the check could not be judged there.

Every replay is written to ``OUT/replays/<n>-<release>.json`` (the scenario, the outcome, the command that
replays it), and the cell links it.  ``OUT/report.md``'s first table is finding x release.  A release that
could not be explored at all is said in its column (``not explored``) and makes the exit status 2.

This module runs the columns' explorations; the cells (by exploration, or by replay) are
`zerostate.reports.matrix_cells`', the report `zerostate.reports.matrix_report`'s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zerostate.targets.interface import Target

from zerostate.reports.matrix_cells import first_line, replay_cells, rows_of
from zerostate.reports.matrix_model import NOT_EXPLORED, Column, ColumnExploration, MatrixReport, MatrixRow, MatrixRun

from zerostate.cli.common import EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, CliError, design


def columns(args: argparse.Namespace) -> list[Column] | None:
    """The matrix ``--deepspeed`` (a list or range of releases) or ``--target model --design`` (a list of
    designs) asks for; None for one release or design (a plain exploration)."""
    if args.target == "model":
        names = requested(args.design) if args.design and "," in args.design else None
        if names is None:
            return None
        for n in names:
            design(n)  # an unknown design is one error line before anything runs
        return [Column(n, "model") for n in names]
    names = requested(args.deepspeed) if args.deepspeed else None
    return [Column(n, "deepspeed") for n in names] if names is not None else None


def requested(spec: str) -> list[str] | None:
    """The releases of a matrix ``--deepspeed`` (``A,B,C`` or ``A..B``), or None for one release."""
    if ".." in spec:
        lo, hi = spec.split("..", 1)
        from zerostate.cli.releases import available_releases, release_range
        return release_range(lo.strip(), hi.strip(), available_releases())
    if "," in spec:
        out = [v.strip() for v in spec.split(",") if v.strip()]
        if len(set(out)) != len(out):
            raise CliError(f"{spec}: named twice in one matrix")
        return out
    return None


# ------------------------------------------------------------------ the explorations
def _explore_command(args: argparse.Namespace, col: Column, out: Path, jobs: int | None,
                     cluster: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "zerostate.cli.main", "explore", *col.explore_args(), "--out", str(out),
           "--examples", str(args.examples), "--json"]
    if col.target == "deepspeed":
        cmd += ["--world-size", str(args.world_size)]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    if args.time_budget:
        cmd += ["--time-budget", str(args.time_budget)]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    if cluster:
        cmd += ["--cluster", cluster]
    return cmd


def explore_column(args: argparse.Namespace, col: Column, out: Path, jobs: int | None,
                   cluster: str | None) -> ColumnExploration:
    """One column's ``zerostate explore`` (its progress on stderr); what the matrix needs of it."""
    release = col.name
    proc = subprocess.run(_explore_command(args, col, out, jobs, cluster), capture_output=True,
                          text=True)
    sys.stderr.write(proc.stderr)
    status = {0: "complete", 1: "complete", EXIT_INTERRUPTED: "interrupted"}.get(proc.returncode, NOT_EXPLORED)
    if status == NOT_EXPLORED:
        why = first_line(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "") or \
            f"exit status {proc.returncode}"
        return ColumnExploration(release, status, out.name, str(out), proc.returncode, why)
    try:
        report = json.loads((out / "report.json").read_text())
    except (OSError, ValueError) as exc:
        return ColumnExploration(release, NOT_EXPLORED, out.name, str(out), proc.returncode,
                                 f"no report.json: {exc}")
    return ColumnExploration.of_report(release, proc.returncode, status, out.name, str(out), report)


# ------------------------------------------------------------------ the command
def run(args: argparse.Namespace, cols: list[Column]) -> int:
    """The matrix of ``cols`` (``zerostate explore`` with a list or range of releases, or of designs)."""
    from zerostate.cli.releases import check_requested
    names = [c.name for c in cols]
    if len(cols) < 2:
        raise CliError(f"{','.join(names)}: a matrix needs at least two releases (or designs)")
    if args.deepspeed_path:
        raise CliError("a release matrix explores releases (--deepspeed A,B,C or A..B); not with --deepspeed-path")
    for c in cols:  # every release checked before anything runs
        if c.target == "deepspeed":
            check_requested(c.name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cluster = _Cluster(args, cols[0]) if args.cluster else None
    status = "complete"
    explored: dict[str, ColumnExploration] = {}
    rows: list[MatrixRow] = []
    try:
        at_once = min(len(cols), cluster.room) if cluster else 1
        jobs = max(1, cluster.room // at_once) if cluster else args.jobs
        address = cluster.address if cluster else None
        lock = threading.Lock()

        def one(c: Column) -> None:
            res = explore_column(args, c, out / c.name, jobs, address)
            with lock:
                explored[c.name] = res
                print(f"  {c.name}: {res.status}" + (f", {len(res.findings)} finding(s)" if res.explored
                                                       else f": {res.error}"),
                      file=sys.stderr, flush=True)
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            list(pool.map(one, cols))
        if any(e.status == "interrupted" for e in explored.values()):
            raise KeyboardInterrupt
        rows = rows_of(cols, explored, args.world_size)
        make = cluster.target_for if cluster else lambda c: _local_target(c, args.world_size)
        rows = replay_cells(rows, cols, explored, out, make, side_by_side=cluster is not None)
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        if cluster:
            cluster.close()
    for r in names:
        explored.setdefault(r, ColumnExploration(r, NOT_EXPLORED, r, str(out / r), error="interrupted before it ran"))
    from zerostate.reports.matrix_report import write
    seconds = round(time.monotonic() - t0, 1)
    run_info = MatrixRun(args.examples, args.seed, args.world_size, cluster.address if cluster else None,
                         bool(cluster), seconds, "zerostate " + " ".join(sys.argv[1:]))
    write(out, MatrixReport(status, tuple(names), cols[0].target, {r: explored[r] for r in names}, run_info,
                            tuple(rows)))
    print(f"release matrix {', '.join(names)}: {len(rows)} finding(s) over {len(names)} column(s), "
          f"{seconds:.0f}s. Report: {out}/report.md")
    for row in rows:
        print(f"  #{row.n} {row.key}: " + ", ".join(f"{r} {row.cells[r].status if r in row.cells else NOT_EXPLORED}"
                                                    for r in names))
    if status != "complete":
        return EXIT_INTERRUPTED
    if any(not e.explored for e in explored.values()):
        return EXIT_USAGE
    return EXIT_FINDINGS if rows else EXIT_OK


def _local_target(col: Column, world_size: int) -> Target:
    from zerostate.targets.interface import get_target
    return get_target(col.target, **col.options(world_size))


class _Cluster:
    """The matrix's cluster: its address for the explorations, its room, and a worker per column for replays."""

    def __init__(self, args: argparse.Namespace, first: Column):
        from zerostate.cli.cluster_cli import ClusterRun
        self.args = args
        self.first = ClusterRun(args.cluster, first.options(args.world_size), args.world_size, kind=first.target)
        self.address = self.first.address
        self.room = self.first.session.lanes
        self.runs: list[Any] = []

    def target_for(self, col: Column) -> Target:
        from zerostate.cli.cluster_cli import ClusterRun
        run = ClusterRun(self.address, col.options(self.args.world_size), self.args.world_size, kind=col.target)
        self.runs.append(run)
        return run.target()

    def close(self) -> None:
        for r in self.runs:
            r.close()
        self.first.close()


__all__ = ["columns", "explore_column", "requested", "run"]
