"""Run every benchmark in this folder, one after another, each in its own process, and write the report.

    python benchmarks/run_all.py [--only NAME ...] [--with NAME=ARGS ...] [--out zerostate-bench]
        [--doc docs/benchmarks.md] [--list]

``NAME`` is a script's stem without ``bench_`` (``hook_overhead``, ``model_check``, ...).  Each
``bench_*.py`` runs with its own defaults and writes ``OUT/<NAME>.json`` (scripts that take ``--json``).
What each prints is kept verbatim in the generated ``--doc`` (default docs/benchmarks.md), under the
script's own description of how it measures, with the command, its wall time and exit status, and the
machine (CPUs, load average before and after, commit).  A run of some benchmarks (``--only``) replaces
their sections and keeps the others.  Nothing here asserts a time.  Exit status: 0 when every script
exited 0, else 1 with the failing names.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTION = re.compile(r"^## `(?P<name>[\w]+)`$", re.M)


def scripts() -> dict[str, Path]:
    return {p.stem[len("bench_"):]: p for p in sorted(HERE.glob("bench_*.py"))}


def how_measured(path: Path) -> str:
    """The script's docstring, which says what it measures and how."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip()


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() or "unknown"


def run_one(name: str, path: Path, out_dir: str, extra: Sequence[str] = ()) -> tuple[int, str]:
    """Run one benchmark (with ``extra`` arguments); its section of the report (markdown)."""
    cmd = [sys.executable, str(path), *extra]
    helptext = subprocess.run(cmd + ["--help"], capture_output=True, text=True, check=False).stdout
    if "--json" in helptext:
        cmd += ["--json", os.path.join(out_dir, f"{name}.json")]
    shown = " ".join(["python", str(path.relative_to(ROOT))] + cmd[2:])
    print(f"== {name}: {shown}", flush=True)
    load_before = _load()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, cwd=ROOT)
    assert proc.stdout is not None
    printed = []
    for line in proc.stdout:
        sys.stdout.write(line)
        printed.append(line)
    rc = proc.wait()
    seconds = time.monotonic() - start
    print(f"== {name}: exit {rc}, {seconds:.0f} s", flush=True)
    section = (f"## `{name}`\n\n{how_measured(path)}\n\n"
               f"`{shown}`: exit {rc}, {seconds:.0f} s wall, load average {load_before} before, {_load()} after, "
               f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {_commit()}.\n\n"
               "```text\n" + "".join(printed).rstrip() + "\n```\n")
    return rc, section


def write_doc(doc: Path, sections: dict[str, str]) -> None:
    """Replace the sections of ``doc`` that were run; keep the others, in the scripts' order."""
    old: dict[str, str] = {}
    if doc.exists():
        text = doc.read_text()
        marks = list(SECTION.finditer(text))
        for i, m in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            old[m.group("name")] = text[m.start():end].rstrip() + "\n"
    merged = {**old, **sections}
    order = [n for n in scripts() if n in merged] + [n for n in merged if n not in scripts()]
    head = ("# Benchmarks\n\nWritten by `make bench` (`benchmarks/run_all.py`); do not edit by hand.  Each section "
            "is one benchmark: how it measures (its own description), the command, the machine it ran on "
            f"({os.cpu_count()} CPUs here) and its load, and what it printed.  Ratios are taken within one run.\n\n")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(head + "\n".join(merged[n] for n in order))


def main(argv: list[str] | None = None) -> int:
    found = scripts()
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(found), help="run only these")
    ap.add_argument("--out", default="zerostate-bench", help="folder for the JSON figures")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="the generated report")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    ap.add_argument("--with", dest="extra", action="append", default=[], metavar="NAME=ARGS",
                    help="arguments for one benchmark (shell words), e.g. --with watch='--only trl-paired'; "
                         "its section shows the command as run")
    args = ap.parse_args(argv)
    extra: dict[str, list[str]] = {}
    for item in args.extra:
        name, sep, words = item.partition("=")
        if not sep or name not in found:
            ap.error(f"--with {item!r}: expected NAME=ARGS with NAME one of {', '.join(sorted(found))}")
        extra[name] = shlex.split(words)
    if args.list:
        print("\n".join(found))
        return 0
    os.makedirs(args.out, exist_ok=True)
    failed = []
    sections: dict[str, str] = {}
    for name in args.only or found:
        rc, sections[name] = run_one(name, found[name], args.out, extra.get(name, ()))
        if rc:
            failed.append(name)
        write_doc(Path(args.doc), sections)  # after each one: a long run keeps what it measured
    print(f"written: {args.doc}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
