"""Coverage of DeepSpeed's ZeRO hook, coordinator and optimizer files by the default exploration.

    python benchmarks/bench_coverage.py explore [--dir DIR] [--examples N] [--seed N]
    python benchmarks/bench_coverage.py [overhead [--examples N]]
    python benchmarks/bench_coverage.py fold DIR [--unit-tests DATA_FILE] [--json OUT] [--md OUT]
    python benchmarks/bench_coverage.py steer [--examples N] [--round N] [--seed N] [--json OUT] [--md OUT]

``explore`` runs the default exploration of the installed DeepSpeed (``zerostate explore``, its own budget
and seed unless given) with ``ZEROSTATE_COVERAGE=DIR/lines`` (harness/coverage_probe.py: every run request of
every worker measured, coverage.py's C tracer, branch coverage, only `coverage_probe.FILES`), then folds.
``fold`` turns the probe's JSON lines into per-file figures: statements and branches (coverage.py's own
analysis of the installed files), how many the exploration ran, and beside them those of a coverage.py
data file (``--unit-tests``: DeepSpeed's own unit tests run under ``coverage run``, see docs/faults.md).
``overhead`` (also what no command runs) runs the same derandomized scenarios (world size 1) alternately on
two fresh workers, one measured, and prints the seconds per example of each.  Writes JSON (default
``zerostate-bench/coverage.json``) and a markdown table (default docs/benchmarks-coverage.md).  Nothing here
asserts a time.

``steer`` compares, at the same budget, the generation phase of the installed DeepSpeed's exploration without
and with ``--steer coverage`` (explorer/rounds.py), every run measured in band (`coverage_probe`): the arcs of
the nine files each reached (importing DeepSpeed's included in both), the arcs only one reached (with the
function each lies in), the findings each met, and the steered run's schedules.  "The same budget" is the
same number of distinct runs: the unsteered run's ``--examples`` are Hypothesis examples, duplicates
included, so the steered one is cut to as many distinct runs, in sequence order, as the unsteered one made.
Shrinking and confirming are off in both (they would add runs the budget does not count).  Default JSON
``zerostate-bench/coverage_steer.json``, markdown docs/benchmarks-steer.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def package_dir() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.origin:
        raise SystemExit("bench_coverage: deepspeed is not installed")
    return Path(spec.origin).resolve().parent


def read_lines(folder: Path) -> tuple[dict[str, set[tuple[int, int]]], list[dict[str, Any]]]:
    """Union of arcs per file over every measured request, and per request its file -> arc count."""
    union: dict[str, set[tuple[int, int]]] = {}
    requests: list[dict[str, Any]] = []
    for path in sorted(folder.glob("cov-*.jsonl")):
        for raw in path.read_text().splitlines():
            line = json.loads(raw)
            for f, arcs in line["arcs"].items():
                union.setdefault(f, set()).update((int(a), int(b)) for a, b in arcs)
            requests.append({"scenario": line["scenario"], "rank": line["rank"], "seconds": line["seconds"]})
    return union, requests


def figures(arcs_by_file: dict[str, set[tuple[int, int]]], package: Path) -> dict[str, dict[str, Any]]:
    """coverage.py's per-file summary (statements, branches, covered) of these arcs over the installed files."""
    import coverage
    from zerostate.harness.coverage_probe import FILES
    cov = coverage.Coverage(data_file=None, branch=True, config_file=False)
    data = cov.get_data()
    data.add_arcs({str(package / f): sorted(arcs) for f, arcs in arcs_by_file.items()})
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"zerostate-cov-{os.getpid()}.json"
    cov.json_report(morfs=[str(package / f) for f in FILES], outfile=str(out))
    report = json.loads(out.read_text())
    out.unlink()
    by_path = {os.path.realpath(p): v["summary"] for p, v in report["files"].items()}
    return {f: _fields(by_path.get(os.path.realpath(package / f), {})) for f in FILES}


def _fields(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary.get(k, 0) for k in ("num_statements", "covered_lines", "num_branches", "covered_branches")}


def unit_test_arcs(data_file: Path, package: Path) -> dict[str, set[tuple[int, int]]]:
    """Arcs of the measured files in a coverage.py data file (e.g. DeepSpeed's unit tests under coverage run)."""
    import coverage
    from zerostate.harness.coverage_probe import FILES
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    wanted = {os.path.realpath(package / f): f for f in FILES}
    out: dict[str, set[tuple[int, int]]] = {}
    for path in data.measured_files():
        f = wanted.get(os.path.realpath(path)) or next(
            (v for v in wanted.values() if path.endswith("/deepspeed/" + v)), None)
        if f:
            out.setdefault(f, set()).update(data.arcs(path) or [])
    return out


_IMPORT = """
import os, sys, coverage
os.environ.setdefault("DS_ACCELERATOR", "cpu")
cov = coverage.Coverage(data_file=sys.argv[1], branch=True, config_file=False, include=sys.argv[2:])
cov.start()
import deepspeed, deepspeed.runtime.engine, deepspeed.runtime.zero.stage3, deepspeed.runtime.zero.stage_1_and_2
import deepspeed.runtime.bf16_optimizer, deepspeed.runtime.fp16.loss_scaler
cov.stop()
cov.save()
"""


def import_arcs(package: Path) -> dict[str, set[tuple[int, int]]]:
    """The arcs of the measured files that importing DeepSpeed runs (definitions, module constants): every
    worker ran them at start-up, before the probe measures any request."""
    from zerostate.harness.coverage_probe import FILES
    data_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"zerostate-cov-import-{os.getpid()}"
    subprocess.run([sys.executable, "-c", _IMPORT, str(data_file), *[str(package / f) for f in FILES]],
                   check=True, capture_output=True)
    try:
        return unit_test_arcs(data_file, package)
    finally:
        data_file.unlink(missing_ok=True)


def _pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.0f}%)" if b else "-"


def fold(folder: Path, unit_tests: Path | None, json_out: Path, md_out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    package = package_dir()
    union, requests = read_lines(folder)
    if not requests:
        raise SystemExit(f"bench_coverage: no measured requests under {folder} (was ZEROSTATE_COVERAGE set?)")
    for f, arcs in import_arcs(package).items():  # the workers imported DeepSpeed before measuring
        union.setdefault(f, set()).update(arcs)
    explore = figures(union, package)
    tests = figures(unit_test_arcs(unit_tests, package), package) if unit_tests else None
    total = {k: sum(v[k] for v in explore.values()) for k in next(iter(explore.values()))}
    result = {**meta, "requests": len(requests), "measured_seconds": round(sum(r["seconds"] for r in requests), 1),
              "explore": explore, "explore_total": total, "unit_tests": tests,
              "unit_tests_total": ({k: sum(v[k] for v in tests.values()) for k in total} if tests else None)}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    rows = [("| file | statements run: exploration | branches run: exploration | statements run: DeepSpeed's "
             "unit tests | branches run: unit tests |"), "| --- | --- | --- | --- | --- |"]
    for f, v in [*explore.items(), ("all", total)]:
        t = (tests or {}).get(f) if f != "all" else result["unit_tests_total"]
        rows.append(f"| `{f}` | {_pct(v['covered_lines'], v['num_statements'])} | "
                    f"{_pct(v['covered_branches'], v['num_branches'])} | "
                    f"{_pct(t['covered_lines'], t['num_statements']) if t else 'not run'} | "
                    f"{_pct(t['covered_branches'], t['num_branches']) if t else 'not run'} |")
    md_out.write_text("# Coverage of DeepSpeed's ZeRO files: the generated table\n\n"
                      f"Generated by `python benchmarks/bench_coverage.py` ({meta.get('what', '')}; "
                      f"{len(requests)} measured run requests). Method and caveats: [faults.md](faults.md).\n\n"
                      + "\n".join(rows) + "\n")
    print("\n".join(rows))
    return result


def explore(folder: Path, examples: int | None, seed: int | None) -> None:
    lines = folder / "lines"
    lines.mkdir(parents=True, exist_ok=True)
    for old in lines.glob("cov-*.jsonl"):
        old.unlink()
    args = [str(Path(sys.executable).with_name("zerostate")), "explore", "--out", str(folder / "report")]
    args += ["--examples", str(examples)] if examples is not None else []
    args += ["--seed", str(seed)] if seed is not None else []
    t0 = time.monotonic()
    subprocess.run(args, env={**os.environ, "ZEROSTATE_COVERAGE": str(lines)}, check=False)
    print(f"explore with coverage: {time.monotonic() - t0:.0f} s wall")


def overhead(n: int) -> dict[str, Any]:
    """Seconds per example of the same ``n`` world-size-1 scenarios on a plain and a measured worker, run
    alternately (each scenario on one, then on the other) so that a change of machine load hits both alike."""
    import tempfile

    from zerostate.explorer.exploration import generated
    from zerostate.explorer.strategies import scenarios
    from zerostate.targets.interface import get_target
    chosen = [sc for sc in dict.fromkeys(generated(scenarios(), 4 * n, None)) if sc.world_size == 1][:n]
    plain = get_target("deepspeed")
    os.environ["ZEROSTATE_COVERAGE"] = tempfile.mkdtemp(prefix="zerostate-cov-overhead-")
    try:
        measured = get_target("deepspeed")  # the worker inherits the environment when it starts
    finally:
        os.environ.pop("ZEROSTATE_COVERAGE", None)
    spent = {"plain": 0.0, "measured": 0.0}
    try:
        for sc in chosen:
            for name, target in (("plain", plain), ("measured", measured)):
                t0 = time.perf_counter()
                target.run(sc)
                spent[name] += time.perf_counter() - t0
    finally:
        plain.close()
        measured.close()
    out: dict[str, Any] = {"examples": len(chosen), **{k: round(v / max(1, len(chosen)), 4) for k, v in spent.items()}}
    out["ratio"] = round(out["measured"] / out["plain"], 2) if out["plain"] else None
    out["load"] = os.getloadavg()[0]
    print(f"{out['examples']} examples: {out['plain']} s/example plain, {out['measured']} s/example measured "
          f"(x{out['ratio']}; load average {out['load']:.1f})")
    return out


def _generation(steer: str | None, examples: int, seed: int | None, round_size: int) -> dict[str, Any]:
    """One exploration's generation phase on the installed DeepSpeed, every run measured: per distinct run in
    sequence order, its arcs per file, and the run's findings, schedules and seconds."""
    import contextlib

    from zerostate.explorer.exploration import Exploration
    from zerostate.harness.coverage_probe import arc_of
    from zerostate.targets.interface import get_target
    target = get_target("deepspeed")
    try:
        if steer is None:
            target.measure_coverage(True)
        exp = Exploration(target, examples=examples, seed=seed, steer=steer, round_size=round_size, shrink=False,
                          confirm=False)
        t0 = time.monotonic()
        with contextlib.closing(exp.events()) as events:
            for _ in events:
                pass
        seconds = time.monotonic() - t0
    finally:
        target.close()
    res = exp.result()
    order = sorted(exp.positions, key=exp.positions.__getitem__)
    ran = [k for k in order if k in exp.memo]
    runs = [{f: {arc_of(i) for i in ids} for f, ids in (exp.memo[k].coverage or {}).items()}
            for k in ran]
    keys = [sorted({f.key for f in exp.memo[k].findings}) for k in ran]
    firsts = {f.key: exp.positions.get(f.scenario) if f.scenario else None for f in res.findings}
    return {"runs": runs, "keys": keys, "findings": firsts, "seconds": round(seconds, 1), "schedules": res.schedules,
            "new_units": res.new_units, "unmeasured": sum(1 for k in order if k in exp.memo
                                                          and exp.memo[k].coverage is None)}


def _function_at(package: Path, f: str, line: int) -> str:
    """The ``def`` a line of a measured file lies in (the nearest one above it)."""
    src = (package / f).read_text().splitlines()
    for i in range(min(abs(line), len(src)) - 1, -1, -1):
        text = src[i].strip()
        if text.startswith(("def ", "async def ")):
            return text.split("(")[0].split()[-1]
    return "<module>"


MODES = {"unsteered": None, "flat": "flat", "steered": "coverage"}
"""The three runs ``steer`` compares: the default generation, the rounds with the default rates (``flat``: what
the rounds' own seeds change) and the rounds reweighed by coverage."""


def steer(examples: int, seed: int | None, round_size: int, json_out: Path, md_out: Path) -> dict[str, Any]:
    package = package_dir()
    base = import_arcs(package)
    got = {name: _generation(mode, examples, seed, round_size) for name, mode in MODES.items()}
    budget = min(len(g["runs"]) for g in got.values())

    def union(runs: list[dict[str, set[tuple[int, int]]]]) -> dict[str, set[tuple[int, int]]]:
        out = {f: set(a) for f, a in base.items()}
        for run in runs[:budget]:
            for f, arcs in run.items():
                out.setdefault(f, set()).update(arcs)
        return out
    u = {name: union(g["runs"]) for name, g in got.items()}
    files = sorted(set().union(*(set(x) for x in u.values())))

    def minus(a: str, *others: str) -> dict[str, list[list[Any]]]:
        out = {}
        for f in files:
            extra = sorted(u[a].get(f, set()) - set().union(*(u[o].get(f, set()) for o in others)))
            if extra:
                out[f] = [[x, y, _function_at(package, f, x if x > 0 else y)] for x, y in extra]
        return out
    only = {"steered-not-unsteered": minus("steered", "unsteered"),
            "unsteered-not-steered": minus("unsteered", "steered"),
            "steered-not-flat": minus("steered", "flat"), "flat-not-steered": minus("flat", "steered"),
            "steered-only": minus("steered", "unsteered", "flat")}
    fig = {name: figures(x, package) for name, x in u.items()}
    total = {k: {m: sum(v[m] for v in fig[k].values()) for m in ("covered_lines", "covered_branches",
                                                                  "num_statements", "num_branches")} for k in fig}
    result = {"deepspeed": _version(), "examples": examples, "seed": seed, "round": round_size,
              "distinct_runs": {**{k: len(g["runs"]) for k, g in got.items()}, "compared": budget},
              "seconds": {k: g["seconds"] for k, g in got.items()},
              "unmeasured_runs": {k: g["unmeasured"] for k, g in got.items()},
              "arcs": {k: sum(len(a) for a in x.values()) for k, x in u.items()}, "files": fig, "total": total,
              "only": only, "findings": {k: g["findings"] for k, g in got.items()},
              "findings_compared": {k: sorted({key for ks in g["keys"][:budget] for key in ks})
                                    for k, g in got.items()},
              "schedules": got["steered"]["schedules"],
              "new_units": {k: got[k]["new_units"] for k in ("flat", "steered")},
              "load": os.getloadavg()[0]}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    md_out.write_text(_steer_markdown(result))
    print(_steer_markdown(result))
    return result


def _version() -> str:
    import importlib.metadata
    return importlib.metadata.version("deepspeed")


def _steer_markdown(r: dict[str, Any]) -> str:
    names = list(MODES)
    rows = ["| file | " + " | ".join(f"branches: {n}" for n in names) + " | arcs steered, not unsteered | "
            "arcs steered, neither other |", "| --- |" + " --- |" * (len(names) + 2)]
    for f in r["files"]["steered"]:
        per = [r["files"][n][f] for n in names]
        rows.append(f"| `{f}` | " + " | ".join(_pct(v["covered_branches"], v["num_branches"]) for v in per)
                    + f" | {len(r['only']['steered-not-unsteered'].get(f, []))} | "
                    f"{len(r['only']['steered-only'].get(f, []))} |")
    t = r["total"]
    rows.append("| all nine | " + " | ".join(_pct(t[n]["covered_branches"], t[n]["num_branches"]) for n in names)
                + f" | {sum(map(len, r['only']['steered-not-unsteered'].values()))} | "
                f"{sum(map(len, r['only']['steered-only'].values()))} |")
    funcs: dict[str, int] = {}
    for f, arcs in r["only"]["steered-only"].items():
        for _, _, fn in arcs:
            funcs[f"{f}:{fn}"] = funcs.get(f"{f}:{fn}", 0) + 1
    top = sorted(funcs.items(), key=lambda kv: (-kv[1], kv[0]))[:15]
    d = r["distinct_runs"]
    if "findings_compared" in r:
        keys = {n: set(r["findings_compared"][n]) for n in names}
        over = f"over the first {d['compared']} distinct runs of each"
    else:  # a result from before findings were cut to the compared runs
        keys = {n: set(r["findings"][n]) for n in names}
        over = ("over each generation's own distinct runs (" + ", ".join(f"{n} {d[n]}" for n in names)
                + "), not the compared budget")
    return ("# Coverage-guided steering: the generated comparison\n\n"
            f"Generated by `python benchmarks/bench_coverage.py steer --examples {r['examples']} --round {r['round']}` "
            f"on DeepSpeed {r['deepspeed']} (installed), seed {r['seed'] if r['seed'] is not None else 'default'}, "
            f"one job, shrinking and confirming off, every run measured in band (load average at the end "
            f"{r['load']:.1f}).  Three generations: the default one (unsteered), rounds of {r['round']} with the "
            "default rates and their own seeds (flat: the control), and the same rounds reweighed by coverage "
            f"(steered).  Distinct runs: {d['unsteered']}, {d['flat']}, {d['steered']}; compared over the first "
            f"{d['compared']} of each, in sequence order (importing DeepSpeed's arcs counted in all).  Seconds: "
            f"{r['seconds']}.  Method: [faults.md](faults.md).\n\n" + "\n".join(rows) + "\n\n"
            f"Arcs of the nine files: {r['arcs']}.  Runs not measured (no coverage in the answer): "
            f"{r['unmeasured_runs']}.\n\n"
            "Where the arcs only the steered run reached (neither the unsteered nor the flat one) lie "
            "(file:function, arcs):\n\n" + "".join(f"- `{k}`: {n}\n" for k, n in top)
            + f"\nFinding keys {over}: " + "; ".join(f"{n} {len(keys[n])}" for n in names)
            + f"; only steered: {sorted(keys['steered'] - keys['unsteered'] - keys['flat']) or 'none'}; "
            f"not steered: {sorted((keys['unsteered'] | keys['flat']) - keys['steered']) or 'none'}.\n\n"
            f"New signal units per folded round (arcs + monitor states): {r['new_units']}.\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="zerostate-bench/coverage.json", help="(no command) the overhead's JSON")
    sub = ap.add_subparsers(dest="cmd")
    e = sub.add_parser("explore")
    e.add_argument("--dir", default="/tmp/faults-cov")
    e.add_argument("--examples", type=int, default=None)
    e.add_argument("--seed", type=int, default=None)
    o = sub.add_parser("overhead")
    o.add_argument("--examples", type=int, default=40)
    f = sub.add_parser("fold")
    f.add_argument("dir")
    st = sub.add_parser("steer")
    st.add_argument("--examples", type=int, default=100)
    st.add_argument("--round", type=int, default=50, help="examples per steering round")
    st.add_argument("--seed", type=int, default=None)
    st.add_argument("--json", default="zerostate-bench/coverage_steer.json")
    st.add_argument("--md", default=str(HERE.parent / "docs" / "benchmarks-steer.md"))
    st.add_argument("--render", default=None, metavar="JSON", help="only write the markdown of a saved result")
    for p in (e, f):
        p.add_argument("--unit-tests", default=None, help="a coverage.py data file of DeepSpeed's unit tests")
        p.add_argument("--json", default="zerostate-bench/coverage.json")
        p.add_argument("--md", default=str(HERE.parent / "docs" / "benchmarks-coverage.md"))
    args = ap.parse_args(argv)
    if args.cmd in ("overhead", None):  # no command (make bench): the overhead, the one short measurement
        result = overhead(getattr(args, "examples", 40))
        out = Path(args.json if args.cmd is None else "zerostate-bench/coverage_overhead.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    if args.cmd == "steer" and args.render:
        Path(args.md).write_text(_steer_markdown(json.loads(Path(args.render).read_text())))
        return 0
    if args.cmd == "steer":
        steer(args.examples, args.seed, args.round, Path(args.json), Path(args.md))
        return 0
    folder = Path(args.dir)
    if args.cmd == "explore":
        explore(folder, args.examples, args.seed)
        folder = folder / "lines"
    what = "the default exploration of the installed DeepSpeed"
    fold(folder, Path(args.unit_tests) if args.unit_tests else None, Path(args.json), Path(args.md), {"what": what})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
