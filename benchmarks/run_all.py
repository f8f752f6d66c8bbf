"""Run every benchmark in this folder, one after another, each in its own process.

    python benchmarks/run_all.py [--only NAME ...] [--out zerostate-bench] [--list]

``NAME`` is a script's stem without ``bench_`` (``hook_overhead``, ``model_check``, ...).  Each
``bench_*.py`` runs with its own defaults and writes ``OUT/<NAME>.json`` (scripts that take
``--json``); their tables are printed as they come.  Exit status: 0 when every script exited 0,
else 1 with the failing names.  `make bench` runs this; `make bench ARGS="--only hook_overhead"`
runs one.  Figures go to README's benchmark table by hand: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scripts() -> dict[str, Path]:
    return {p.stem[len("bench_"):]: p for p in sorted(HERE.glob("bench_*.py"))}


def main(argv: list[str] | None = None) -> int:
    found = scripts()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(found), help="run only these")
    ap.add_argument("--out", default="zerostate-bench", help="folder for the JSON figures")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(found))
        return 0
    os.makedirs(args.out, exist_ok=True)
    failed = []
    for name in args.only or found:
        path = found[name]
        cmd = [sys.executable, str(path)]
        helptext = subprocess.run(cmd + ["--help"], capture_output=True, text=True).stdout
        if "--json" in helptext:
            cmd += ["--json", os.path.join(args.out, f"{name}.json")]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.monotonic()
        rc = subprocess.run(cmd).returncode
        print(f"== {name}: exit {rc}, {time.monotonic() - start:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
