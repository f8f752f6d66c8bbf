"""What writing a finding into a report costs: its PNG pictures and its repro script, per finding.

    python benchmarks/bench_report_writing.py [--examples 60] [--design ds-0.18.4] [--json OUT]

An exploration writes each finding three times (handed over unshrunk, shrunk, renumbered at the end), in the
thread that follows the exploration's events, so what a finding's files cost is paid three times in the
exploration's wall clock.  This explores a model design (no DeepSpeed: the findings come in milliseconds),
then, for each finding, times its trace picture (drawn, as SVG, as PNG), its repro script (the embedded code
built the first time, kept after) and the whole `Report.add_finding`, first and again with the same picture
(as the renumbering writes it: its PNG copied, not rasterised).  Where git and matplotlib are there, the
same canvases are also rasterised by matplotlib with the PNG writer of commit ``c32b17e`` (read from git, not
copied here), the one before the Pillow writer: the ratio is of the two in one run, on the same pictures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD_PNG_COMMIT = "c32b17e"


def _old_canvas() -> types.ModuleType | None:
    """reports/canvas.py as of `OLD_PNG_COMMIT` (matplotlib's PNG), or None without git or matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    try:
        src = subprocess.run(["git", "show", f"{OLD_PNG_COMMIT}:reports/canvas.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    mod = types.ModuleType("old_canvas")
    sys.modules[mod.__name__] = mod  # its dataclass looks its module up
    exec(compile(src, f"{OLD_PNG_COMMIT}:reports/canvas.py", "exec"), mod.__dict__)
    return mod


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f}" if values else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=60)
    p.add_argument("--design", default="ds-0.18.4")
    p.add_argument("--json", default="zerostate-bench/report_writing.json")
    args = p.parse_args(argv)

    from zerostate.explorer.exploration import explore
    from zerostate.harness import repro
    from zerostate.reports import trace_picture
    from zerostate.reports.repro_file import repro_for
    from zerostate.reports.report_folder import Report
    from zerostate.specs import SPECS
    import zerostate.targets  # noqa: F401  (registers the targets)
    from zerostate.targets.interface import get_target

    res = explore(get_target("model", design=args.design), examples=args.examples, seed=None)
    findings = [f for f in res.findings if f.trace]
    old = _old_canvas()
    t: dict[str, list[float]] = {k: [] for k in ("draw", "svg", "png", "png_matplotlib", "repro_first",
                                                 "repro_kept", "add_finding", "add_finding_again")}
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        report = Report(tmp, "explore", {"target": "model", "design": args.design}, [f"model:{args.design}"],
                        specs=SPECS)
        repro._EMBEDDED.clear()
        for n, f in enumerate(findings, 1):
            t0 = time.perf_counter()
            canvas = trace_picture.trace_picture(f.trace, f.index, f"{f.check} violated", f.error)
            t1 = time.perf_counter()
            canvas.to_svg()
            t2 = time.perf_counter()
            canvas.to_png(f"{tmp}/p{n}.png")
            t3 = time.perf_counter()
            t["draw"].append(t1 - t0)
            t["svg"].append(t2 - t1)
            t["png"].append(t3 - t2)
            if old is not None:
                legacy = old.Canvas(canvas.width, canvas.height, canvas.background, list(canvas.shapes))
                t4 = time.perf_counter()
                legacy.to_png(f"{tmp}/m{n}.png")
                t["png_matplotlib"].append(time.perf_counter() - t4)
            script = repro_for(f.scenario, f.check, f.error, f)
            t5 = time.perf_counter()
            script(n)
            t["repro_first" if n == 1 else "repro_kept"].append(time.perf_counter() - t5)
            t6 = time.perf_counter()
            report.add_finding(f, design=args.design, repro=script)
            t["add_finding"].append(time.perf_counter() - t6)
        for n, f in enumerate(findings, 1):  # as explore's renumbering writes each again: the same pictures
            t7 = time.perf_counter()
            report.add_finding(f, design=args.design, repro=repro_for(f.scenario, f.check, f.error, f), replace=n)
            t["add_finding_again"].append(time.perf_counter() - t7)
    result = {"design": args.design, "examples": args.examples, "findings": len(findings),
              "median_ms": {k: (round(1000 * statistics.median(v), 2) if v else None) for k, v in t.items()},
              "total_s": {k: round(sum(v), 2) for k, v in t.items()}}
    print(f"{len(findings)} findings of {args.design} ({args.examples} examples), median per finding, ms:\n")
    print("| trace drawn | SVG | PNG (Pillow) | PNG (matplotlib, c32b17e) | repro script (first; kept) "
          "| Report.add_finding (first; again) |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {_ms(t['draw'])} | {_ms(t['svg'])} | {_ms(t['png'])} | {_ms(t['png_matplotlib'])} "
          f"| {_ms(t['repro_first'])}; {_ms(t['repro_kept'])} "
          f"| {_ms(t['add_finding'])}; {_ms(t['add_finding_again'])} |")
    if t["png_matplotlib"]:
        ratio = statistics.median(t["png_matplotlib"]) / statistics.median(t["png"])
        result["png_ratio"] = round(ratio, 1)
        print(f"\nPNG: Pillow {ratio:.0f}x faster than matplotlib on the same {len(findings)} pictures")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
