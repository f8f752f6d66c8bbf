"""Fault injection: does the default exploration notice a small fault a pull request introduces?

    python benchmarks/bench_faults.py [--faults ID ...] [--examples N] [--seed N] [--tree DIR]
        [--runs DIR] [--full] [--rerun] [--table-only] [--json OUT] [--md OUT] [--list]

Each fault of ``benchmarks/faults/catalogue.py`` is applied to a copy of the installed DeepSpeed (``--tree``,
made once from the installed package, laid out as ``--deepspeed-path`` takes it) and explored with the
default command, ``zerostate explore --deepspeed-path TREE`` (``--examples`` / ``--seed`` change the budget
and seed, for the faulted and the unfaulted run alike).  The unfaulted tree is explored once with the same
command and its report cached (``RUNS/baseline*/report.json``).  The rule (docs/faults.md,
``faults/verdict.py``): killed when the faulted run reports a key the unfaulted run does not, or a finding
under an old key whose example fails on the faulted tree and passes on the unfaulted one (the first
``--replay-old`` such findings are replayed on both trees, after the run), tool errors apart.  By default a
faulted run stops at the first new key (Ctrl-C, the report kept); that finding is then replayed in a fresh
worker on the faulted tree and on the unfaulted tree: a key the unfaulted tree shows on replay is not the
fault's, and the faulted exploration runs again without it.  ``--full`` explores to the
end whatever is found.  A fault that is not killed always ran to the end.

Per fault: the verdict, the killing finding, seconds from the start of the exploration to the report write
that first held it (the report is polled every 0.5 s), distinct runs by then, the replays.  Results are kept
per fault (``RUNS/<id>.json``) and reused unless ``--rerun``; ``--table-only`` rewrites the table from them.
Writes JSON (``--json``, default ``zerostate-bench/faults.json``) and a markdown table (``--md``, default
docs/benchmarks-faults.md).  Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from faults.apply import applied, make_tree  # noqa: E402
from faults.catalogue import FAULTS, RELEASE, Fault, by_id  # noqa: E402
from faults.labels import replay_labels, still_wrong  # noqa: E402
from faults.runner import ExploreRun, explore, replay  # noqa: E402
from faults.table import fault_lines, markdown, reached, summary  # noqa: E402
from faults.verdict import (SeenFinding, changed_examples, final_labels, fixed, grown_examples,  # noqa: E402
                            introduced, judge, new_labels, old_key_candidates, peak_grew, shows)

FAST_S = 120.0
REPLAY_OLD = 8
"""How many findings under old keys (the unfaulted run's) a faulted run replays, first seen first: each on the
unfaulted tree, and on the faulted tree those the unfaulted tree passed."""
REPLAY_OLD_S = 300.0
"""The most one such replay may take (a hang there is not judged)."""
EXAMPLE_REPEAT = 3
"""A changed example is replayed up to this many times on each tree (`changed_examples`): it passes on the
unfaulted tree only if no run shows its key -- an intermittent one is not the fault's."""


def keep_from(table: Path, runs: Path, label: str) -> list[str]:
    """The results of an earlier ``--json`` output written to ``runs`` for the faults that have none there, each
    with the run it was measured in (``measured``: its own, else ``label``); the ids written."""
    written = []
    for r in json.loads(table.read_text())["faults"]:
        path = runs / f"{r['id']}.json"
        if r["id"] in by_id() and not path.exists():
            path.write_text(json.dumps({**r, "measured": r.get("measured") or label}, indent=2) + "\n")
            written.append(r["id"])
    return written


def installed_package() -> Path:
    import deepspeed
    return Path(deepspeed.__file__).resolve().parent


def check_pristine(tree: Path, package: Path) -> None:
    """Every file the catalogue touches is byte for byte the installed one (no fault left applied)."""
    for f in {fault.file for fault in FAULTS}:
        if (tree / "deepspeed" / f).read_bytes() != (package / f).read_bytes():
            raise SystemExit(f"bench_faults: {tree / 'deepspeed' / f} differs from the installed release: "
                             "a fault was left applied? remove the tree to rebuild it")


def baseline_dir(runs: Path, examples: int | None, seed: int | None) -> Path:
    return runs / ("baseline" + (f"-e{examples}" if examples is not None else "")
                   + (f"-s{seed}" if seed is not None else ""))


def read_examples(out: Path) -> list[dict[str, Any]]:
    """A run's ``examples.jsonl`` (each generated example's outcome); empty if it wrote none."""
    path = out / "examples.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def baseline(tree: Path, runs: Path, examples: int | None, seed: int | None) -> dict[str, Any]:
    """The unfaulted run's report, explored once per (examples, seed) and cached."""
    name = baseline_dir(runs, examples, seed).name
    report_path = runs / name / "report.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
        if report.get("status") == "complete":
            return report
    print(f"baseline: exploring the unfaulted tree ({name}) ...", flush=True)
    run = explore(tree, runs / name, runs / f"{name}.log", examples, seed)
    if run.report.get("status") != "complete":
        raise SystemExit(f"bench_faults: the unfaulted exploration did not complete (see {runs / name}.log)")
    return run.report


def _entry(report: dict[str, Any], key: str) -> dict[str, Any] | None:
    return next((e for e in report.get("findings", []) if e.get("key") == key), None)


def run_fault(fault: Fault, tree: Path, runs: Path, base: dict[str, Any], examples: int | None,
              seed: int | None, full: bool, cut_s: float | None, replay_old: int = REPLAY_OLD) -> dict[str, Any]:
    """Explore ``fault`` applied to ``tree``; replay its killing finding on the faulted and unfaulted tree, and
    the first ``replay_old`` findings under keys the unfaulted run has (seen before that kill) on the unfaulted
    tree, and on the faulted tree those it passed."""
    base_findings = base.get("findings", [])
    ignored: set[str] = set()
    out = runs / fault.id
    t0 = time.monotonic()
    attempt = 0
    while attempt < 3:  # a key the unfaulted tree shows on replay is dropped and the tree explored again
        attempt += 1
        frozen = frozenset(ignored)

        def killed(seen: list[SeenFinding], frozen: frozenset[str] = frozen) -> bool:
            return judge(base_findings, seen, frozen).status == "killed"

        with applied(fault, tree):
            run: ExploreRun = explore(tree, out, runs / f"{fault.id}.log", examples, seed,
                                      None if full else killed, cut_s=cut_s)
            verdict = judge(base_findings, run.seen, frozen)
            replays: dict[str, Any] = {}
            entry = _entry(run.report, verdict.killer["key"]) if verdict.killer else None
            if entry is not None:
                replays["faulted"] = replay(out / entry["files"]["scenario"], tree,
                                            runs / f"{fault.id}.replay-faulted.log")
            old = old_key_candidates(base_findings, run.seen, replay_old,
                                     verdict.killer["seconds"] if verdict.killer else None,
                                     run.report.get("findings", []))
        old_replays = _replay_each(old, run.report, out, tree, runs / f"{fault.id}.replay-old", "unfaulted")
        if any(r["unfaulted"].get("passed") is True for r in old_replays.values()):
            with applied(fault, tree):  # only an example the unfaulted tree passes can be the fault's
                _replay_each(old, run.report, out, tree, runs / f"{fault.id}.replay-old", "faulted", old_replays)
        if entry is not None:
            replays["unfaulted"] = replay(out / entry["files"]["scenario"], tree,
                                          runs / f"{fault.id}.replay-unfaulted.log")
            if shows(replays["unfaulted"]):  # the unfaulted tree has it too: not the fault's
                ignored.add(verdict.killer["key"] if verdict.killer else "")
                continue
        break
    made = frozenset(k for k, r in old_replays.items() if introduced(r.get("faulted", {}), r.get("unfaulted", {})))
    verdict = judge(base_findings, run.seen, frozenset(ignored), made)
    example_replays = _replay_changed(fault, tree, out, baseline_dir(runs, examples, seed), base_findings,
                                      replay_old, verdict.killer["seconds"] if verdict.killer else None)
    def as_seen(r: dict[str, Any]) -> SeenFinding:
        shown = r["faulted"] if r["direction"] == "gained" else r["unfaulted"]  # the run that failed
        return SeenFinding(key=r["key"], check=r["check"], error=str(shown.get("error") or ""), known_issue=None,
                           seconds=r["seconds"],
                           examples=None, n=10_000 + r["position"])  # distinct runs by then: not recorded
    made_examples = [as_seen(r) for r in example_replays
                     if r["direction"] == "gained" and introduced(r["faulted"], r["unfaulted"])]
    fixed_examples = [as_seen(r) for r in example_replays
                      if r["direction"] == "lost" and fixed(r["faulted"], r["unfaulted"])]
    verdict = judge(base_findings, run.seen, frozenset(ignored), made, made_examples, fixed_examples)
    grown_rows = _measure_grown(fault, tree, out, baseline_dir(runs, examples, seed), replay_old,
                                verdict.killer["seconds"] if verdict.killer else None)
    grown = [SeenFinding(key="memory:gathered-peak", check="gathered-peak", error=(
        f"gathered-parameter peak {r['base']} -> {r['head']} elements in the exploration, "
        f"{_peak(r['unfaulted'])} -> {_peak(r['faulted'])} measured again (unfaulted -> faulted)"),
        known_issue=None, seconds=r["seconds"], examples=None, n=10_000 + r["position"])
        for r in grown_rows if confirmed_growth(r)]
    verdict = judge(base_findings, run.seen, frozenset(ignored), made, made_examples, fixed_examples, grown)
    labels = final_labels(new_labels(base_findings, run.seen), run.report)
    label_rows = _replay_labels(fault, tree, runs, run.report, [x for x in labels if x["label"] and x["label"] !=
                                                                 fault.reintroduces])
    if verdict.status != "killed" and not finished(run):
        return {"id": fault.id, "status": "incomplete", "run": {
            "status": run.report.get("status"), "returncode": run.returncode, "wall_s": round(run.wall_s, 1)}}
    if verdict.rule == "memory" and verdict.killer is not None:
        replays = next({"faulted": r["faulted"], "unfaulted": r["unfaulted"]} for r in grown_rows
                       if 10_000 + r["position"] == verdict.killer["n"])
    elif verdict.rule in ("introduced", "fixed") and verdict.killer is not None:
        replays = next(({"faulted": r["faulted"], "unfaulted": r["unfaulted"]} for r in example_replays
                        if 10_000 + r["position"] == verdict.killer["n"]), None) or old_replays[verdict.killer["key"]]
    return {"id": fault.id, "area": fault.area, "file": fault.file, "rationale": fault.rationale,
            "cpu_blind": fault.cpu_blind, "status": verdict.status, "rule": verdict.rule,
            "killer": verdict.killer, "hidden_by_label": verdict.hidden_by_label,
            "new_keys": verdict.new_keys, "tool_errors": verdict.tool_errors,
            "new_labels": labels,
            "wrong_labels": still_wrong(label_rows), "label_replays": label_rows,
            "ignored_keys": sorted(ignored), "attempts": attempt,
            "replays": {k: _short(v) for k, v in replays.items()},
            "old_key_replays": {k: {side: _short(a) for side, a in r.items()} for k, r in old_replays.items()},
            "example_replays": [{**{k: r[k] for k in ("position", "seconds", "key", "check", "direction")},
                                 **{side: _short(r[side]) for side in ("unfaulted", "faulted") if r[side]}}
                                for r in example_replays],
            "grown_examples": [{**{k: r[k] for k in ("position", "seconds", "base", "head")},
                                **{side: _short(r[side]) for side in ("unfaulted", "faulted") if r[side]}}
                               for r in grown_rows],
            "run": {"status": run.report.get("status"), "stopped_early": run.stopped_early,
                    "cut_s": cut_s if run.cut else None,
                    "examples_run": run.report.get("run", {}).get("examples_run"),
                    "report_seconds": run.report.get("run", {}).get("seconds"), "wall_s": round(run.wall_s, 1),
                    "returncode": run.returncode},
            "bench_wall_s": round(time.monotonic() - t0, 1)}


def _replay_labels(fault: Fault, tree: Path, runs: Path, report: dict[str, Any],
                   candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The new findings labelled by another known issue than the fault's, each replayed on the unfaulted ``tree``
    (`faults.labels`): a label the release shows on that scenario is the release's own bug, not the fault read as
    known."""
    return replay_labels(candidates, report, runs / fault.id, lambda f, log: replay(f, tree, log),
                         runs / f"{fault.id}.label")


def relabel(fault: Fault, tree: Path, runs: Path) -> bool:
    """``--relabel``: the label replays of a kept result (its report under RUNS) made again on the unfaulted tree;
    its ``wrong_labels`` rewritten from them.  False when it has no kept result with new labels."""
    kept = runs / f"{fault.id}.json"
    report_path = runs / fault.id / "report.json"
    if not kept.exists() or not report_path.exists():
        return False
    result = json.loads(kept.read_text())
    if "new_labels" not in result:
        return False
    report = json.loads(report_path.read_text())
    first = [{"key": x["key"], "label": x.get("first_label", x["label"])} for x in result["new_labels"]]
    labels = final_labels(first, report)
    candidates = [x for x in labels if x["label"] and x["label"] != fault.reintroduces]
    rows = _replay_labels(fault, tree, runs, report, candidates)
    result.update(new_labels=labels, wrong_labels=still_wrong(rows), label_replays=rows)
    kept.write_text(json.dumps(result, indent=2) + "\n")
    return True


def _replay_changed(fault: Fault, tree: Path, out: Path, base_dir: Path, base_findings: list[dict[str, Any]],
                    limit: int, before_s: float | None) -> list[dict[str, Any]]:
    """`changed_examples` of the faulted run (``out``) against the unfaulted one (seen before a kill already
    made), each replayed in a fresh worker up to `EXAMPLE_REPEAT` times: on the unfaulted tree, then on the
    faulted tree those where the unfaulted replay can still make a kill (``gained``: it passed; ``lost``: it
    showed the key).  Each: the example's row plus ``unfaulted`` and ``faulted``
    (`runner.replay`'s answers; ``{}`` where not replayed)."""
    changed = [r for r in changed_examples(read_examples(base_dir), read_examples(out), base_findings, limit)
               if before_s is None or r["seconds"] < before_s]

    def worth(r: dict[str, Any]) -> bool:
        return r["unfaulted"].get("passed") is True if r["direction"] == "gained" else shows(r["unfaulted"])
    return _replay_both(fault, tree, out.parent, changed, "example", lambda r: {
        "check": r["check"], "key": r["key"], "scenario": r["scenario"], "repeat": EXAMPLE_REPEAT}, worth)


def _measure_grown(fault: Fault, tree: Path, out: Path, base_dir: Path, limit: int,
                   before_s: float | None) -> list[dict[str, Any]]:
    """`grown_examples` of the faulted run (``out``) against the unfaulted one (seen before a kill already
    made), each run again in a fresh worker on both trees (`runner.replay` of the plain scenario, whose answer
    holds the run's ``gathered`` metrics).  Each: the example's row plus ``unfaulted`` and ``faulted``."""
    grown = [r for r in grown_examples(read_examples(base_dir), read_examples(out), limit)
             if before_s is None or r["seconds"] < before_s]
    return _replay_both(fault, tree, out.parent, grown, "grown", lambda r: r["scenario"], lambda r: True)


def _replay_both(fault: Fault, tree: Path, runs: Path, found: list[dict[str, Any]], tag: str,
                 content: Callable[[dict[str, Any]], dict[str, Any]],
                 worth: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """Each of ``found`` written as a file ``content(row)`` and replayed in a fresh worker on the unfaulted
    tree, then on the faulted tree where ``worth(row)`` says the unfaulted answer can still make a kill."""
    folder = runs / f"{fault.id}.examples"
    folder.mkdir(exist_ok=True)
    rows = []
    for r in found:
        path = folder / f"{tag}_{r['position']}.json"
        path.write_text(json.dumps(content(r), indent=2) + "\n")
        log = runs / f"{fault.id}.{tag}-{r['position']}"
        rows.append({**r, "file": path, "unfaulted": replay(path, tree, Path(f"{log}-unfaulted.log"),
                                                            timeout_s=REPLAY_OLD_S), "faulted": {}})
    if any(map(worth, rows)):
        with applied(fault, tree):
            for r in rows:
                if worth(r):
                    r["faulted"] = replay(r["file"], tree, Path(f"{runs / fault.id}.{tag}-{r['position']}"
                                                                f"-faulted.log"), timeout_s=REPLAY_OLD_S)
    return rows


def _peak(answer: dict[str, Any]) -> str:
    gathered = answer.get("gathered")
    return str(gathered["peak_elements"]) if isinstance(gathered, dict) else "unmeasured"


def confirmed_growth(row: dict[str, Any]) -> bool:
    """The growth seen in the exploration holds when the example is run again, on each tree in a fresh worker."""
    a, b = row["unfaulted"].get("gathered"), row["faulted"].get("gathered")
    return isinstance(a, dict) and isinstance(b, dict) and peak_grew(int(a["peak_elements"]),
                                                                     int(b["peak_elements"]))


def finished(run: ExploreRun) -> bool:
    """A run that can say "survived": it ran to its end, or this benchmark cut it (``--cut-s``).  One stopped
    from outside (a signal, a worker killed, explore's own error) saw only part of the sequence: no verdict."""
    return run.report.get("status") == "complete" or run.cut


def _replay_each(found: list[SeenFinding], report: dict[str, Any], out: Path, tree: Path, log: Path, side: str,
                 into: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Replay each of ``found`` (its finding file in ``report``) on ``tree`` as ``side``, into ``into`` (key ->
    side -> `runner.replay`'s answer).  The unfaulted side comes first; the faulted side replays only what
    the unfaulted tree passed (the others cannot be `introduced`)."""
    into = {} if into is None else into
    for f in found:
        entry = _entry(report, f["key"])
        passed_unfaulted = into.get(f["key"], {}).get("unfaulted", {}).get("passed") is True
        if entry is None or (side == "faulted" and not passed_unfaulted):
            continue
        into.setdefault(f["key"], {})[side] = replay(out / entry["files"]["scenario"], tree,
                                                     Path(f"{log}-{f['n']}-{side}.log"), timeout_s=REPLAY_OLD_S)
    return into


def _short(answer: dict[str, Any]) -> dict[str, Any]:
    keep = ("passed", "check", "same_key", "error", "sequence", "runs", "gathered")
    out = {k: answer.get(k) for k in keep if k in answer}
    if isinstance(out.get("error"), str):
        out["error"] = out["error"].strip().splitlines()[0][:300] if out["error"].strip() else ""
    return out


def mark_reached(results: list[dict[str, Any]], lines_dir: Path) -> None:
    """Set each result's ``line_reached``: did any request of the measured exploration run the fault's lines."""
    covered: dict[str, set[int]] = {}
    for path in sorted(lines_dir.glob("cov-*.jsonl")):
        for raw in path.read_text().splitlines():
            for f, arcs in json.loads(raw)["arcs"].items():
                covered.setdefault(f, set()).update(abs(n) for arc in arcs for n in arc)
    package = installed_package()
    for r in results:
        fault = by_id()[r["id"]]
        lines = fault_lines(fault.original, (package / fault.file).read_text())
        r["line_reached"] = reached(lines, covered.get(fault.file, set()))


def _claimed(claim: Path) -> bool:
    """Claim a fault for this process: two benchmarks sharing ``--runs`` (each on its own ``--tree``) never
    run the same fault.  False when another holds it."""
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        print(f"{claim.stem}: claimed by another run, skipped", flush=True)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", nargs="+", metavar="ID", help="run only these faults (default: all)")
    ap.add_argument("--examples", type=int, default=None, help="explore's --examples (default: explore's own)")
    ap.add_argument("--seed", type=int, default=None, help="explore's --seed (default: explore's own)")
    ap.add_argument("--tree", default="/tmp/faults-tree", help="where the copy of the installed DeepSpeed lives")
    ap.add_argument("--runs", default="/tmp/faults-runs", help="reports, logs and per-fault results")
    ap.add_argument("--full", action="store_true", help="explore to the end even once a fault is killed")
    ap.add_argument("--cut-s", type=float, default=None, metavar="S",
                    help="end a faulted run with no kill after S seconds of exploring (its verdict then counts only "
                         "what it saw: a kill can only be missed, never made); default: run to the end")
    ap.add_argument("--replay-old", type=int, default=REPLAY_OLD, metavar="N",
                    help="replay the first N findings under keys the unfaulted run also has on both trees: one "
                         "that fails on the faulted tree and passes on the unfaulted one kills (default %(default)s)")
    ap.add_argument("--rerun", action="store_true", help="run faults that already have a result")
    ap.add_argument("--table-only", action="store_true", help="only rewrite the table from kept results")
    ap.add_argument("--json", default="zerostate-bench/faults.json")
    ap.add_argument("--md", default=str(HERE.parent / "docs" / "benchmarks-faults.md"))
    ap.add_argument("--coverage", metavar="DIR", help="a bench_coverage.py lines folder: say for each fault "
                    "whether the unfaulted exploration measured there ran its faulted lines")
    ap.add_argument("--keep-from", metavar="JSON", help="an earlier --json output (docs/benchmarks-faults.json): "
                    "its results are kept for the faults RUNS has none for, each labelled with the run it came from")
    ap.add_argument("--label", default="an earlier run", help="with --keep-from: the label of its results that "
                    "carry none (the ones its own run measured)")
    ap.add_argument("--relabel", action="store_true", help="replay the labelled new findings of the kept results on "
                    "the unfaulted tree again (a label the release shows there is its own bug) and rewrite the table")
    ap.add_argument("--list", action="store_true", help="list the faults and exit")
    args = ap.parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C: the applied fault is taken back and the running exploration ended
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    catalogue = by_id()
    if args.list:
        for f in FAULTS:
            print(f"{f.id:36} {f.area:12} {f.file}{'  [cpu-blind]' if f.cpu_blind else ''}")
        return 0
    unknown = sorted(set(args.faults or []) - set(catalogue))
    if unknown:
        print(f"bench_faults: unknown fault(s) {', '.join(unknown)} (--list shows them)", file=sys.stderr)
        return 2
    chosen = [catalogue[i] for i in args.faults] if args.faults else list(FAULTS)
    runs, tree = Path(args.runs), Path(args.tree)
    runs.mkdir(parents=True, exist_ok=True)
    if args.keep_from:
        print(f"kept from {args.keep_from}: {', '.join(keep_from(Path(args.keep_from), runs, args.label)) or 'none'}")
    results: list[dict[str, Any]] = []
    if args.relabel:
        package = installed_package()
        check_pristine(tree, package)
        for fault in chosen:
            print(f"{fault.id}: {'relabelled' if relabel(fault, tree, runs) else 'no kept result with new labels'}",
                  flush=True)
        args.table_only = True
    if not args.table_only:
        package = installed_package()
        if not (tree / "deepspeed" / "__init__.py").exists():
            make_tree(package, tree)
        check_pristine(tree, package)
        base = baseline(tree, runs, args.examples, args.seed)
        print(f"baseline: {len(base.get('findings', []))} findings in {base['run'].get('seconds')} s", flush=True)
    for fault in chosen:
        kept = runs / f"{fault.id}.json"
        if kept.exists() and (args.table_only or not args.rerun):
            # whether it is argued equivalent is the catalogue's, now: an argument made since applies to it
            results.append({**json.loads(kept.read_text()), "cpu_blind": fault.cpu_blind})
            continue
        if args.table_only or not _claimed(runs / f"{fault.id}.claim"):
            continue
        try:
            print(f"{fault.id}: exploring ...", flush=True)
            result = run_fault(fault, tree, runs, base, args.examples, args.seed, args.full, args.cut_s,
                               args.replay_old)
            check_pristine(tree, package)
            if result["status"] == "incomplete":  # not kept: the next run of the benchmark runs it again
                print(f"{fault.id}: incomplete -- the exploration ended before its end or its cut "
                      f"({result['run']}): no verdict, run it again", flush=True)
                continue
            kept.write_text(json.dumps(result, indent=2) + "\n")
        finally:
            (runs / f"{fault.id}.claim").unlink(missing_ok=True)
        results.append(result)
        killer = result["killer"]
        tail = f" by {killer['key']} ({result['rule']}) at {killer['seconds']:.1f} s" if killer else ""
        print(f"{fault.id}: {result['status']}{tail}", flush=True)
    if args.coverage:
        mark_reached(results, Path(args.coverage))
    meta = {"release": RELEASE, "examples": args.examples, "seed": args.seed, "fast_s": FAST_S, "cut_s": args.cut_s}
    figures = summary(results, FAST_S)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({**meta, "summary": figures, "faults": results}, indent=2) + "\n")
    Path(args.md).write_text(markdown(results, figures, meta))
    print(figures["sentence"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
