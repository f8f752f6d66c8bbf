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
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict
from collections.abc import Callable

from zerostate.model.scenario import Scenario
from zerostate.targets.base import Outcome, Target

from zerostate.explorer.workers import has_run, refresh

from zerostate.cli.common import EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, CliError, design

PRESENT, ABSENT, CRASHED = "present", "absent", "crashed before"
_STOPPED = frozenset({"exception", "crash", "hang", "internal"})


class Cell(TypedDict):
    status: str
    by: str
    """``exploration`` (its own report has it) or ``replay``."""
    link: str
    replay: str
    """The command that replays it on this release."""
    detail: str


@dataclass(frozen=True)
class Column:
    """One column of the matrix: a DeepSpeed release (``target`` deepspeed) or a model design (model)."""

    name: str
    target: str

    def explore_args(self) -> list[str]:
        return ["--deepspeed", self.name] if self.target == "deepspeed" else ["--target", "model", "--design",
                                                                               self.name]

    def replay_args(self) -> str:
        return f" --deepspeed {self.name}" if self.target == "deepspeed" else f" --target model --design {self.name}"

    def options(self, world_size: int) -> dict[str, Any]:
        """Its target's options, as `targets.base.get_target` takes them."""
        if self.target == "deepspeed":
            return {"deepspeed": self.name, "world_size": world_size}
        return {"design": self.name}


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


def cell_of(out: Outcome, key: str) -> tuple[str, str]:
    """A replay's cell: ``present`` when it shows ``key``; ``crashed before`` when the release stopped first
    (raised, crashed, hung); else ``absent``.  With the first line of what it showed instead."""
    if any(f.key == key for f in out.findings):
        return PRESENT, ""
    stopped = [f for f in out.findings if f.check in _STOPPED]
    if stopped or out.error:
        first = stopped[0].error if stopped else out.error or ""
        return CRASHED, (stopped[0].check + ": " if stopped else "") + _line(first)
    others = ", ".join(sorted({f.key for f in out.findings}))
    return ABSENT, (f"other findings: {others}" if others else "clean")


def _line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[0][:200] if lines else ""


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
                   cluster: str | None) -> dict[str, Any]:
    """One column's ``zerostate explore`` (its progress on stderr); what the matrix needs of it."""
    release = col.name
    proc = subprocess.run(_explore_command(args, col, out, jobs, cluster), capture_output=True,
                          text=True)
    sys.stderr.write(proc.stderr)
    status = {0: "complete", 1: "complete", EXIT_INTERRUPTED: "interrupted"}.get(proc.returncode, "not explored")
    res: dict[str, Any] = {"release": release, "exit": proc.returncode, "status": status, "out": out.name,
                           "path": str(out)}
    if status == "not explored":
        res["error"] = _line(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "") or \
            f"exit status {proc.returncode}"
        return res
    try:
        report = json.loads((out / "report.json").read_text())
    except (OSError, ValueError) as exc:
        return {**res, "status": "not explored", "error": f"no report.json: {exc}"}
    res.update(examples=report["run"].get("examples_run"), findings=report["findings"],
               reliability=report.get("reliability"), deepspeed=report["run"].get("deepspeed"),
               report_status=report.get("status"))
    return res


# ------------------------------------------------------------------ the cells
def replay_cells(rows: list[dict[str, Any]], cols: list[Column], explored: dict[str, dict[str, Any]],
                 out: Path, make_target: Callable[[Column], Target], side_by_side: bool) -> None:
    """Fill every cell the explorations left empty by replaying the finding's scenario on that column."""
    releases = [c.name for c in cols]
    by_name = {c.name: c for c in cols}
    todo: dict[str, list[dict[str, Any]]] = {r: [] for r in releases}
    for row in rows:
        for r in releases:
            if r not in row["cells"] and explored[r]["status"] != "not explored":
                todo[r].append(row)
    (out / "replays").mkdir(exist_ok=True)

    def one_release(r: str) -> None:
        if not todo[r]:
            return
        t = make_target(by_name[r])
        try:
            for row in todo[r]:
                row["cells"][r] = _replay(t, row, by_name[r], out)
        finally:
            t.close()

    with ThreadPoolExecutor(max_workers=len(releases) if side_by_side else 1) as pool:
        list(pool.map(one_release, releases))


def _replay(t: Target, row: dict[str, Any], col: Column, out: Path) -> Cell:
    """The finding's scenario (after its sequence, for an order-dependent one) in a fresh worker of ``t``."""
    release = col.name
    if has_run(t):
        refresh(t)
    for sc in row["sequence"]:
        t.run(sc)
    o = t.run(row["scenario"])
    status, detail = cell_of(o, row["key"])
    rel = f"replays/{row['n']}-{release}.json"
    command = f"zerostate replay {row['source_file']}{col.replay_args()}" + _ws(row)
    (out / rel).write_text(json.dumps({
        "release": release, "finding": row["n"], "key": row["key"], "status": status, "detail": detail,
        "command": command, "scenario": row["scenario"].to_dict(),
        "sequence": [s.to_dict() for s in row["sequence"]],
        "outcome": {"error": _line(o.error or ""), "findings": [{"check": f.check, "key": f.key,
                                                                  "error": _line(f.error)} for f in o.findings]},
    }, indent=2) + "\n")
    return {"status": status, "by": "replay", "link": rel, "replay": command, "detail": detail}


def _sequence(finding_file: Path) -> list[Scenario]:
    """An order-dependent finding's examples to run first (its finding file's ``sequence``)."""
    try:
        data = json.loads(finding_file.read_text())
    except (OSError, ValueError):
        return []
    return [Scenario.from_dict(d) for d in data.get("sequence") or []]


def _ws(row: dict[str, Any]) -> str:
    ws = max(row["scenario"].world_size, row["world_size"])
    return f" --world-size {ws}" if ws > 1 else ""


def rows_of(cols: list[Column], explored: dict[str, dict[str, Any]], world_size: int = 1) -> list[dict[str, Any]]:
    """One row per finding key, in the order of the first column that found it and its number there; the
    cells its own explorations give.  ``world_size``: the matrix's (``--world-size``); a row replays at it, or at
    its scenario's when that is larger."""
    rows: dict[str, dict[str, Any]] = {}
    for col in cols:
        r = col.name
        for f in explored[r].get("findings") or []:
            i = f["n"]
            key = f.get("key") or f["check"]
            if key not in rows:
                seq = _sequence(Path(explored[r]["path"]) / f"finding_{i}.json")
                rows[key] = {"key": key, "check": f["check"], "error": _line(f.get("error", "")),
                             "known_issue": (f.get("known_issue") or {}).get("id"), "source": r,
                             "source_file": f"{explored[r]['out']}/finding_{i}.json",
                             "scenario": Scenario.from_dict(f["scenario"]), "sequence": seq, "cells": {},
                             "world_size": world_size}
            row = rows[key]
            link = f"{explored[r]['out']}/finding_{i}.json"
            row["cells"][r] = {"status": PRESENT, "by": "exploration", "link": link,
                               "replay": f"zerostate replay {link}{col.replay_args()}" + _ws(row), "detail": ""}
    out = list(rows.values())
    for n, row in enumerate(out, 1):
        row["n"] = n
    return out


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
    explored: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    try:
        at_once = min(len(cols), cluster.room) if cluster else 1
        jobs = max(1, cluster.room // at_once) if cluster else args.jobs
        address = cluster.address if cluster else None
        lock = threading.Lock()

        def one(c: Column) -> None:
            res = explore_column(args, c, out / c.name, jobs, address)
            with lock:
                explored[c.name] = res
                print(f"  {c.name}: {res['status']}" + (f", {len(res.get('findings') or [])} finding(s)"
                                                        if res["status"] != "not explored"
                                                        else f": {res.get('error')}"),
                      file=sys.stderr, flush=True)
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            list(pool.map(one, cols))
        if any(e["status"] == "interrupted" for e in explored.values()):
            raise KeyboardInterrupt
        rows = rows_of(cols, explored, args.world_size)
        make = cluster.target_for if cluster else lambda c: _local_target(c, args.world_size)
        replay_cells(rows, cols, explored, out, make, side_by_side=cluster is not None)
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        if cluster:
            cluster.close()
    for r in names:
        explored.setdefault(r, {"release": r, "status": "not explored", "error": "interrupted before it ran",
                                "out": r, "path": str(out / r)})
    from zerostate.reports.matrix_report import write
    seconds = round(time.monotonic() - t0, 1)
    explorations = {r: {k: v for k, v in explored[r].items() if k not in ("findings", "path")}
                    | {"findings": [f.get("key") for f in explored[r].get("findings") or []]} for r in names}
    run_info = {"examples": args.examples, "seed": args.seed, "world size": args.world_size,
                "cluster": cluster.address if cluster else None, "side by side": bool(cluster), "seconds": seconds,
                "command line": "zerostate " + " ".join(sys.argv[1:])}
    result: dict[str, Any] = {"command": "explore (release matrix)", "status": status, "releases": names,
                              "target": cols[0].target, "explorations": explorations, "run": run_info}
    write(out, result, rows)
    print(f"release matrix {', '.join(names)}: {len(rows)} finding(s) over {len(names)} column(s), "
          f"{seconds:.0f}s. Report: {out}/report.md")
    for row in rows:
        print(f"  #{row['n']} {row['key']}: " + ", ".join(f"{r} {row['cells'].get(r, {}).get('status', 'not explored')}"
                                                      for r in names))
    if status != "complete":
        return EXIT_INTERRUPTED
    if any(e["status"] == "not explored" for e in explored.values()):
        return EXIT_USAGE
    return EXIT_FINDINGS if rows else EXIT_OK


def _local_target(col: Column, world_size: int) -> Target:
    from zerostate.targets.base import get_target
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


__all__ = ["ABSENT", "CRASHED", "Cell", "Column", "PRESENT", "cell_of", "columns", "explore_column", "replay_cells",
           "requested", "rows_of", "run"]
