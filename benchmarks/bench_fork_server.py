"""The default exploration with and without the fork server (or the searches ahead), in one run: the same findings,
the two wall clocks.

    python benchmarks/bench_fork_server.py [--pair fork|ahead] [--deepspeed 0.19.8] [--examples 200] [--seed N]
                                           [--json OUT]

Runs ``zerostate explore`` twice, one after the other, each a fresh process with its own report folder.  ``fork``
(the default): first with ``--no-fork-server`` (every lane's worker, every confirmation replay and every rank pool
started as new processes), then with the fork server (forked from a warm server per release and world size).
``ahead``: both forked, first with ``ZEROSTATE_SEARCH_AHEAD=0`` (shrinking's runs on the first worker alone, the
other worker only confirming), then with the keys next in line searched ahead on every worker (`explorer.ahead`).
The draw cache (`explorer.draw_cache`) is off in both, so neither run reads draws the other kept.  Compares the two
reports' findings -- key, known-issue label, check, the scenario and the first line of the error (its numbers) --
and prints both wall clocks, their ratio, and each run's ``time`` line: the shrinking phase, worker starts (how many
forked), seconds waited for them, the explorer's own CPU, and the wall clock over the runs' own CPU seconds divided
by the cores (the limit this design can reach).  Exit status 1 when the findings differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


PAIRS = {"fork": (("started", {"fork": False}), ("forked", {})),
         "ahead": (("one-shrinking-worker", {"ahead": False}), ("searched-ahead", {}))}
"""Each pair's two runs, the control first: name -> what it turns off."""


def _explore(args: argparse.Namespace, out: Path, fork: bool = True, ahead: bool = True) -> dict:
    cmd = [sys.executable, "-m", "zerostate.cli.main", "explore", "--examples", str(args.examples), "--out", str(out),
           "--json"]
    if args.deepspeed:
        cmd += ["--deepspeed", args.deepspeed]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    if not fork:
        cmd.append("--no-fork-server")
    env = dict(os.environ, ZEROSTATE_DRAW_CACHE="0", ZEROSTATE_SEARCH_AHEAD="1" if ahead else "0")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    return {"wall": round(wall, 1), "report": report}


def _findings(report: dict) -> list[tuple]:
    out = []
    for f in report.get("findings", []):
        msg = str(f.get("error") or f.get("violation_event") or "").splitlines()
        out.append((f.get("key"), (f.get("known_issue") or {}).get("id"), f.get("check"),
                    json.dumps(f.get("scenario"), sort_keys=True), msg[0] if msg else ""))
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", choices=sorted(PAIRS), default="fork",
                   help="fork: without and with the fork server; ahead: without and with the searches ahead")
    p.add_argument("--deepspeed", default=None, metavar="VERSION", help="release (default: the installed one)")
    p.add_argument("--examples", type=int, default=200, help="examples per search (default 200: explore's default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default=None, help="default: zerostate-bench/fork_server.json (ahead: search_ahead.json)")
    args = p.parse_args(argv)
    pair = PAIRS[args.pair]
    names = [n for n, _ in pair]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-fork-") as tmp:
        for name, off in pair:
            runs[name] = _explore(args, Path(tmp) / name, **off)
            print(f"{name}: {runs[name]['wall']:.0f} s wall", flush=True)
    a, b = (_findings(runs[n]["report"]) for n in names)
    same = a == b
    ratio = runs[names[0]]["wall"] / max(runs[names[1]]["wall"], 1e-9)
    result = {"pair": args.pair, "examples": args.examples, "deepspeed": args.deepspeed or "installed",
              "same_findings": same,
              "findings": len(a), "ratio": round(ratio, 2), "cores": os.cpu_count(),
              **{n: {"wall": r["wall"], "time": r["report"].get("summary", {}).get("time")} for n, r in runs.items()}}
    print("\n| run | wall (s) | shrinking (s) | findings | worker starts (forked) | waited for starts (s) "
          "| explorer's own CPU (s) | wall / (runs' CPU / cores) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        t = runs[n]["report"].get("summary", {}).get("time") or {}
        s = t.get("spent") or {}
        own = (t.get("explorer_cpu") or {}).get("seconds", "?")
        print(f"| {n} | {runs[n]['wall']:.0f} | {(t.get('phases') or {}).get('shrinking', 0):.0f} "
              f"| {len(_findings(runs[n]['report']))} | {s.get('starts', '?')} "
              f"({s.get('forked_starts', 0)}) | {s.get('start_waited', 0):.0f} | {own} "
              f"| {t.get('wall_over_limit', '?')} |")
    with_what = "the fork server" if args.pair == "fork" else "the searches ahead"
    print(f"\nwith {with_what} {ratio:.2f}x faster; findings (key, label, check, scenario, message) "
          f"{'the same' if same else 'DIFFER'} ({len(a)} and {len(b)})")
    if not same:
        for f in sorted(set(a) ^ set(b)):
            print(f"  only {names[0] if f in a else names[1]}: {f[0]} [{f[1]}] {f[4][:120]}")
    out = Path(args.json or f"zerostate-bench/{'fork_server' if args.pair == 'fork' else 'search_ahead'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
