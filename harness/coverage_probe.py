"""Opt-in line and branch coverage of DeepSpeed's ZeRO hook, coordinator and optimizer files, per example.

Two ways to ask, both off by default.  **In band**: a run request with ``"coverage": true`` runs under
coverage.py's tracer and its answer carries ``coverage`` (`ArcIds`: per file, the arcs it ran as `arc_id`
integers), which the target puts on ``Outcome.coverage`` (what ``zerostate explore --steer coverage`` steers by).
**To files**: off unless ``ZEROSTATE_COVERAGE=DIR`` is in a worker's environment (a worker inherits the
environment of the ``zerostate`` command that starts it), so the default exploration runs exactly as without it.
When set, every ``run`` request a worker serves (generated, shrinking and confirming runs alike, in both kinds of
worker) runs under coverage.py's C tracer, restricted to `FILES` of the DeepSpeed the worker imported, branch
coverage on (``ZEROSTATE_COVERAGE_EVERY=K``: one request in K, a sample), and one JSON line per traced request is
appended to ``DIR/cov-<rank>-<pid>.jsonl``: the scenario's hash, the seconds the traced run took, and per file the
arcs it ran (coverage.py's ``(from, to)`` line pairs; the lines are their ends).  ``benchmarks/bench_coverage.py``
folds the files into per-file figures.

Only threads started through ``threading`` and the calling thread are traced: a hook that autograd's C++
worker threads run is not traced (on CPU the autograd engine runs a backward on the calling thread).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any, TypedDict, TypeVar

ENV = "ZEROSTATE_COVERAGE"
EVERY_ENV = "ZEROSTATE_COVERAGE_EVERY"
"""Measure one request in this many (default 1: all): a sample, where measuring every request costs too much."""

FILES = (
    "runtime/base_optimizer.py",
    "runtime/utils.py",
    "runtime/engine.py",
    "runtime/zero/stage3.py",
    "runtime/zero/stage_1_and_2.py",
    "runtime/zero/partitioned_param_coordinator.py",
    "runtime/zero/parameter_offload.py",
    "runtime/bf16_optimizer.py",
    "runtime/fp16/loss_scaler.py",
)
"""The files coverage.py traces, relative to the ``deepspeed`` package: ZeRO's gradient hooks and hook state, the
ZeRO-3 coordinator and module hooks, the engine's backward/step, and the optimizers' step and loss scaling."""


ArcIds = dict[str, list[int]]
"""File (relative to the package, one of `FILES`) -> the sorted `arc_id` of each arc a run executed."""

_HALF = 1 << 19
"""Line numbers (coverage.py writes an entry or exit as minus the code object's first line) lie in
(-_HALF, _HALF): each end of an arc fits in 20 bits."""


def arc_id(arc: tuple[int, int]) -> int:
    """One non-negative integer per coverage.py arc ``(from, to)``: the pair needs no table (the same id in
    every worker of every release, nothing to build at start-up) and is as short in JSON as a table index."""
    a, b = arc
    return ((a + _HALF) << 20) | (b + _HALF)


def arc_of(ident: int) -> tuple[int, int]:
    """The arc of an `arc_id`."""
    return (ident >> 20) - _HALF, (ident & ((1 << 20) - 1)) - _HALF


class CoverageLine(TypedDict):
    """One request the probe traced, as written to the JSON-lines file (crosses from the worker to the benchmark)."""

    scenario: str
    """sha1 of the scenario's JSON (sorted keys)."""
    rank: int
    seconds: float
    arcs: dict[str, list[list[int]]]
    """File (relative to the package) -> the arcs the run executed."""


T = TypeVar("T")


class Meter:
    """coverage.py's C tracer over `FILES` of one DeepSpeed package, branch level: one traced call at a time."""

    def __init__(self, package_dir: Path) -> None:
        import coverage  # the opt-in's one dependency (the test extra installs it)

        self._paths = {str(package_dir / f): f for f in FILES}
        self._cov = coverage.Coverage(data_file=None, branch=True, include=list(self._paths), config_file=False)
        self._cov.set_option("run:disable_warnings", ["no-data-collected"])  # a run may skip every traced file

    def measure(self, run: Callable[[], T], done: Callable[[dict[str, list[tuple[int, int]]]], None]) -> T:
        """``run()``'s answer; ``done(arcs per file)`` is called even when ``run`` raises."""
        self._cov.erase()
        self._cov.start()
        try:
            return run()
        finally:
            self._cov.stop()
            data = self._cov.get_data()
            done({self._paths[path]: sorted(data.arcs(path) or [])
                  for path in data.measured_files() if path in self._paths})


def in_band(arcs: Mapping[str, list[tuple[int, int]]]) -> ArcIds:
    return {f: sorted(arc_id(a) for a in got) for f, got in arcs.items()}


class Probe:
    """Measures one request at a time; writes its line when the request is done."""

    def __init__(self, out_dir: Path, package_dir: Path, every: int = 1) -> None:
        self.meter = Meter(package_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self._rank = int(os.environ.get("RANK", "0"))
        self._out = out_dir / f"cov-{self._rank}-{os.getpid()}.jsonl"
        self._every = max(1, every)
        self._seen = 0

    def around(self, request: Mapping[str, Any], run: Callable[[], T],
               also: Callable[[dict[str, list[tuple[int, int]]]], None] | None = None) -> T:
        """``run()``'s answer, traced (one request in ``every``, and every request that ``also`` wants the
        arcs of); the line is written even when ``run`` raises."""
        self._seen += 1
        sampled = not (self._seen - 1) % self._every
        if not sampled and also is None:
            return run()
        t0 = time.perf_counter()

        def done(arcs: dict[str, list[tuple[int, int]]]) -> None:
            if sampled:
                self._write(request, time.perf_counter() - t0, arcs)
            if also is not None:
                also(arcs)
        return self.meter.measure(run, done)

    def _write(self, request: Mapping[str, Any], seconds: float,
               arcs_by_file: dict[str, list[tuple[int, int]]]) -> None:
        arcs = {f: [[a, b] for a, b in got] for f, got in arcs_by_file.items()}
        scenario = json.dumps(request.get("scenario"), sort_keys=True, default=str)
        line = CoverageLine(scenario=hashlib.sha1(scenario.encode()).hexdigest(), rank=self._rank,
                            seconds=round(seconds, 4), arcs=arcs)
        with open(self._out, "a") as fh:
            fh.write(json.dumps(line) + "\n")


def from_env(hello: Mapping[str, Any]) -> Probe | None:
    """The probe ``ZEROSTATE_COVERAGE`` asks for, over the DeepSpeed that ``hello`` says was imported; None
    when it is not set or the worker did not start.  Raises ImportError (coverage.py not installed): an
    opt-in that cannot trace must not pass for one that traced nothing."""
    out = os.environ.get(ENV)
    if not out or not hello.get("ok") or not hello.get("file"):
        return None
    return Probe(Path(out), Path(str(hello["file"])).resolve().parent, int(os.environ.get(EVERY_ENV, "1")))


__all__ = ["ENV", "EVERY_ENV", "FILES", "ArcIds", "CoverageLine", "Meter", "Probe", "arc_id", "arc_of", "from_env",
           "in_band"]
