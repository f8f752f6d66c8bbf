"""The report of ``zerostate diff``: diff.md (for a pull request), diff.json, and finding_<n>.json per finding.

diff.json serialises the `DiffReport` `cmd_diff.run` builds (also printed by ``--json``); diff.md renders it:
the verdict, the findings by status (introduced / fixed / intermittent / unmasked / unchanged) with their known
issue and the other build's replay, findings grouped by root cause, and gathered-parameter memory and
all-gathers per scenario family.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from zerostate.atomic import replace_file

from zerostate.reports.diff_memory import MemoryComparison
from zerostate.reports.diff_model import DiffEntry, DiffReport, DiffSide, OtherBuildReplay
from zerostate.reports.finding_entry import KnownIssue
from zerostate.reports.root_causes import root_causes


def write_report(out_dir: str, result: DiffReport) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for e in result.findings:
        replace_file(os.path.join(out_dir, e.file), json.dumps({"check": e.check, "error": e.error,
                                                                "scenario": e.scenario}, indent=2) + "\n")
    replace_file(os.path.join(out_dir, "diff.json"), json.dumps(result.to_json(), indent=2) + "\n")
    replace_file(os.path.join(out_dir, "diff.md"), render(result, out_dir))


def _replay_cmd(out_dir: str, e: DiffEntry, side: DiffSide) -> str:
    spec = side.spec
    opt = "--deepspeed-path" if os.path.isdir(os.path.expanduser(spec)) else "--deepspeed"
    return f"zerostate replay {os.path.join(out_dir, e.file)} {opt} {spec}"


def render(r: DiffReport, out_dir: str = ".") -> str:
    out = _head(r) + ["## Findings", ""]
    if not r.findings:
        out += ["None on either build.", ""]
    else:
        out += ["| # | status | check | known issue | found on | replay on the other build |",
                "|---|---|---|---|---|---|"]
        for e in r.findings:
            out.append(f"| [{e.n}](#diff-{e.n}) | **{e.status}** | `{e.check}` | "
                       f"{_issue(e.known_issue)} | {e.found_on} | {_evidence(e.replay)} |")
        out += ["", *_groups(r.findings)]
        for e in r.findings:
            out += _detail(e, r, out_dir)
    out += _memory(r.memory)
    return "\n".join(out) + "\n"


def _issue(k: KnownIssue | None) -> str:
    """A known issue as a table cell: its id, and "limitation" for one DeepSpeed documents."""
    if not k:
        return "none (new)"
    return f"`{k.id}`" + (" (documented limitation)" if k.limitation else "")


def _head(r: DiffReport) -> list[str]:
    """The title, the verdict with the counts, the two builds and how they were explored."""
    b, h, c = r.base, r.head, r.counts
    verdict = (f"**{r.verdict}**: {c['fixed']} fixed, {c['not-reached']} not reached (head's run stopped before the "
               f"step where base failed), {c['introduced']} introduced, {c['intermittent']} "
               f"intermittent (shown on the other build in some replays only), {c['unmasked']} unmasked (a known "
               f"bug of base that base's run stopped before), {c['unchanged']} unchanged; "
               f"{len(r.memory.regressions)} gathered-parameter memory regression(s) beyond "
               f"{r.memory.tolerance:.0%}.")
    seed = r.seed if r.seed is not None else "0 (fixed default)"
    given = ", plus the scenario(s) " + ", ".join(r.scenarios) if r.scenarios else ""
    how = (f"Same exploration on both builds: seed {seed}, {r.examples} examples per search, world size "
           f"{r.world_size}{given}; {r.seconds:.0f} s.  Command: `{r.command_line}`")
    return [f"# zerostate diff: {b.name} → {h.name}", "", verdict, "",
            "| | base | head |", "|---|---|---|",
            f"| build | {b.name} | {h.name} |",
            f"| exploration | {b.exploration} | {h.exploration} |",
            f"| distinct runs (replays included) | {b.runs} | {h.runs} |", "", how, ""]


def _evidence(rep: OtherBuildReplay) -> str:
    shown = "clean (no finding)" if rep.clean else "; ".join(
        f"`{f.check}`: {f.error[:80]}" for f in rep.findings).replace("|", "\\|")
    return f"{shown}; {_runs(rep)}"


def _runs(rep: OtherBuildReplay) -> str:
    """How often the replays showed the finding."""
    return f"the finding in {rep.hits} of {rep.runs} run(s)"


def _groups(entries: Sequence[DiffEntry]) -> list[str]:
    gs = root_causes(entries)
    out = [f"Root causes: {len(gs)} for {len(entries)} finding(s).", "",
           "| root cause | known issue (fixed in) | findings | count |", "|---|---|---|---|"]
    for g in gs:
        k = g.known_issue
        ki = f"{_issue(k)} ({k.fixed_in or 'not fixed'})" if k else "none (new)"
        out.append(f"| {g.title} | {ki} | " + ", ".join(f"#{n}" for n in g.findings) + f" | {g.count} |")
    return out + [""]


def _detail(e: DiffEntry, r: DiffReport, out_dir: str) -> list[str]:
    other_side = e.other_side
    rep = e.replay
    k = e.known_issue
    out = [f'<a id="diff-{e.n}"></a>', f"### {e.n}. {e.status}: `{e.check}` (found on {e.found_on})", ""]
    if k:
        kind = "limitation" if k.limitation else "bug"
        fixed = f"first fixed in {k.fixed_in}" if k.fixed_in else "not fixed in any release"
        out += [f"Known {kind} `{k.id}` ({k.owner}; {fixed}): {k.title}", ""]
    shown = "clean, no finding" if rep.clean else "; ".join(f"`{f.check}` {f.error}" for f in rep.findings)
    out += ["```text", e.error.strip().splitlines()[0] if e.error.strip() else "", "```", "",
            "Scenario (shrunk):", "", "```text", e.description, "```", "",
            f"Replay on {other_side}: {shown} (first run); {_runs(rep)}.", "",
            "```sh", _replay_cmd(out_dir, e, r.base) + "    # base",
            _replay_cmd(out_dir, e, r.head) + "    # head", "```", ""]
    return out


def _fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and x.is_integer() and x > 5:
        return str(int(x))
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def _memory(m: MemoryComparison) -> list[str]:
    out = ["## Gathered-parameter memory and all-gathers (ZeRO-3)", "",
           ("Per scenario family, over the scenarios both explorations ran to the end: real gathered-parameter "
            "peak (elements) and all-gathers, medians base → head, head/base ratios (median, worst, best)."), ""]
    if not m.families:
        return out + ["No ZeRO-3 scenario ran to the end on both builds.", ""]
    out += [("| family | scenarios | peak base → head (median) | peak ratio median / worst / best | "
             "all-gathers base → head (median) | all-gather ratio median / worst / best |"),
            "|---|---|---|---|---|---|"]
    for f in m.families:
        p, a = f.peak_elements, f.all_gathers
        out.append(f"| {f.family} | {f.scenarios} | {_fmt(p.base_median)} → {_fmt(p.head_median)} | "
                   f"{_fmt(p.median_ratio)} / {_fmt(p.worst_ratio)} / {_fmt(p.best_ratio)} | "
                   f"{_fmt(a.base_median)} → {_fmt(a.head_median)} | "
                   f"{_fmt(a.median_ratio)} / {_fmt(a.worst_ratio)} / {_fmt(a.best_ratio)} |")
    out += ["", "Where base and head differ most, per family:", ""]
    for f in m.families:
        for summary, what in ((f.peak_elements, "peak"), (f.all_gathers, "all-gathers")):
            d = summary.differ_most
            if d.base != d.head:
                out.append(f"- {f.family}, {what}: {d.base} → {d.head} in: {d.description}")
    if m.regressions:
        out += ["", f"**Memory regressions** (peak above base times {1 + m.tolerance:.2f}):", ""]
        out += [f"- {g.family}: {g.figures.base} → {g.figures.head} elements in: {g.figures.description}"
                for g in m.regressions]
    return out + [""]


__all__ = ["render", "write_report"]
