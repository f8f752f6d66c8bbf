"""report.md: the human half of a run's report, rendered from the `RunReport` that report.json serialises."""

from __future__ import annotations

from collections.abc import Sequence

from zerostate.explorer.time_spent import time_line
from zerostate.reports.finding_entry import FindingEntry, KnownIssue
from zerostate.reports.json_value import Json, as_list, as_object
from zerostate.reports.root_causes import root_causes
from zerostate.reports.run_report import NOT_CHECKED, Reliability, RunReport

_RUN_KEYS = (("target", "target"), ("deepspeed", "DeepSpeed release"), ("design", "design"),
             ("examples", "budget (examples)"), ("examples_run", "distinct runs (the examples, then shrinking)"),
             ("time_budget", "time budget (s)"), ("stopped", "stopped"), ("bound", "bound"),
             ("seed", "seed"), ("started", "started (UTC)"), ("seconds", "seconds"),
             ("cluster", "cluster"), ("command_line", "command line"))


def render_markdown(d: RunReport) -> str:
    run = d.run.to_json()
    out = [f"# zerostate {d.command} report", ""]
    if d.status != "complete":
        out += [f"**Status: {d.status}** — this report holds every finding found so far.", ""]
    out += ["| | |", "|---|---|"]
    out += [f"| {label} | {_cell(run[key])} |" for key, label in _RUN_KEYS if run.get(key) is not None]
    if d.command == "explore" and run.get("seed") is None:
        out.insert(-1, "| seed | fixed default seed (0): the same examples every run |")
    out += _reliability(d.reliability)
    out += _time(d.summary.get("time"))
    out += ["", "## Specs", "", "| spec | " + " | ".join(d.columns) + " | findings |",
            "|---" * (len(d.columns) + 2) + "|"]
    for sid, row in d.specs.items():
        cells = [_result(row.results.get(c, NOT_CHECKED)) for c in d.columns]
        found = ", ".join(f"[#{n}](#finding-{n})" for n in row.findings) or "—"
        out.append(f"| `{sid}` | " + " | ".join(cells) + f" | {found} |")
    out += [""] + [f"- `{sid}`: {row.sentence}" for sid, row in d.specs.items() if row.sentence]
    if d.summary_text:
        out += ["", "## Summary", "", "```text", d.summary_text.rstrip(), "```"]
    about, own = d.about_the_target, d.own_failures
    out += _groups(about)
    if d.harness_errors is not None:
        out += ["", (f"harness errors: {len(own)} (zerostate's own failures, listed apart below; none is a finding "
                     "about DeepSpeed)")]
    out += ["", f"## Findings ({len(about)})", ""]
    if not about:
        out += ["None.", ""]
    for f in about:
        out += _finding(f)
    if own:
        out += ["", f"## Harness errors ({len(own)})", "",
                ("zerostate itself failed here -- its oracle, its executor, its own code, or building the scenario "
                 "before DeepSpeed ran.  A project bug, not a finding about DeepSpeed."), ""]
        for f in own:
            out += _finding(f)
    return "\n".join(out) + "\n"


_SAY = {"confirmed": "confirmed: replayed alone in a fresh worker, it reproduces",
        "order-dependent": "order-dependent: it does not reproduce alone in a fresh worker, only after the "
                           "examples below (the replay command and the repro script run them first)",
        "intermittent": "intermittent: neither alone nor after the examples before it, but in some of "
                        "several runs of it alone in one fresh worker (a race; the replay command repeats it)",
        "not-reproduced": "NOT reproduced: neither alone in a fresh worker nor after the examples that ran "
                          "before it in the same worker",
        "not-checked": "not confirmed: the run was interrupted before its replay"}


def _time(t: Json) -> list[str]:
    """Explore's ``time`` (`explorer.time_spent.breakdown`) as a short section."""
    if not isinstance(t, dict):
        return []
    return ["", "## Where the time went", "", time_line(t).removeprefix("time: "), "",
            ("(A run's CPU is its worker processes' own, every rank's; the limit is what the runs alone would take "
             "on these cores.)")]


def _reliability(rel: Reliability | None) -> list[str]:
    if rel is None:
        return []
    out = ["", "## Reliability", "",
           f"- findings confirmed by a replay in a fresh worker: {rel.confirmed} / {rel.reported}",
           f"- order-dependent (reproduce only after earlier examples, sequence given): {rel.order_dependent}",
           f"- intermittent (a race: reproduces in some of several runs alone): {rel.intermittent}"
           + (" -- another run of the same command meets each of these only at about its rate, and a finding "
              "hidden under the same key (check and code) in this run may take its place there; every other "
              "finding is the same in every run" if rel.intermittent else ""),
           f"- not reproduced: {rel.not_reproduced}; not checked (interrupted): {rel.not_checked}",
           f"- worker restarts: {len(rel.restarts)}"]
    out += [f"  - after example {r.get('example')}: {r.get('why')}" for r in rel.restarts[:20]]
    if len(rel.restarts) > 20:
        out.append(f"  - ... ({len(rel.restarts) - 20} more in report.json)")
    if rel.cluster_retries is not None:  # a lost cluster worker's lane is run again from its start: same examples
        out.append(f"- lanes run again on the cluster (a worker or its node lost): {len(rel.cluster_retries)}")
        out += [f"  - worker {r['worker']} on node {str(r['node'])[:8]}: {r['why']}; {r['replayed']} run(s) of its "
                f"lane run again first" + (f"; DIFFERED: {'; '.join(map(str, as_list(r['differed'])))}"
                                           if r["differed"] else "")
                for r in map(as_object, rel.cluster_retries)]
    return out


def _scenario_title(f: FindingEntry) -> str:
    """explore hands a finding over unshrunk first (``shrunk: false``), then rewrites it shrunk; a finding
    the budget or a stop left as seen says so."""
    if f.shrunk is False:
        return ("Scenario (unshrunk: the first example found; shrinking and confirming follow):"
                if f.stage == "unshrunk" else "Scenario (as seen, not shrunk: the run ended first):")
    return "Scenario (shrunk):"


def _finding(f: FindingEntry) -> list[str]:
    n, files = f.n, f.files
    produced_by = f" on `{f.design}`" if f.design else f" on {f.where}" if f.where else ""
    out = [f'<a id="finding-{n}"></a>', f"### Finding {n}: `{f.check}`{produced_by}", "",
           *_known(f), "```text", f.error.strip(), "```", "", _scenario_title(f), "",
           "```text", f.description, "```", ""]
    if f.confirmation:
        c = f.confirmation
        rate = f" ({c.hits} of {c.repeat} runs)" if c.repeat else ""
        out += [f"Replay before hand-over: {_SAY.get(c.status, c.status)}{rate}.", ""]
    if f.sequence:
        out += [f"Run first, in order ({len(f.sequence)}):", "", "```text"]
        out += [f"[{i}] " + d.replace("\n", "\n    ") for i, d in enumerate(f.sequence, 1)] + ["```", ""]
    if f.events_around:
        out += ["Events around the violation (`>>` marks the violating event):", "", "```text"]
        out += [f"{'>>' if e.violation else '  '} {e.index:4d}  {e.event}" for e in f.events_around]
        out += ["```", ""]
    for key, label in (("trace_svg", "event sequence"), ("graph_svg", "state graph")):
        if key in files:
            png = files.get(key.replace("svg", "png"))
            out.append(f"![{label}]({files[key]})" + (f" ([PNG]({png}))" if png else ""))
    out += ["", "Replay:", "", "```sh", f.replay]
    if f.replay_release:
        out += [f.replay_release + "    # on the real release this design models"]
    if f.labels is not None and not f.known_issue and not f.harness_error and f.where:
        out += [f.replay + " --ablate    # without each trigger in turn: what is left of it"]
    out += ["```", ""]
    if "repro" in files:
        out += [f"Standalone repro ([{files['repro']}]({files['repro']})), exits non-zero while the bug is present:",
                "", "```sh", f"python {files['repro']}                      # CPU",
                f"deepspeed --num_gpus 1 {files['repro']}      # GPU", "```", ""]
    out += [f"Note: {note}" for note in f.notes]
    return out + [""]


def _groups(findings: Sequence[FindingEntry]) -> list[str]:
    """Findings grouped by root cause (known/labels.py), each group with its known issue and count."""
    gs = root_causes(findings)
    if not gs:
        return []
    out = ["", f"## Root causes ({len(gs)} for {len(findings)} finding(s))", "",
           "| root cause | known issue | kind | owner | fixed in | findings | count |", "|---|---|---|---|---|---|---|"]
    for g in gs:
        k = g.known_issue
        out.append(f"| {g.title} | {'`' + k.id + '`' if k else '**new** (no known issue)'} | "
                   f"{_nature(k) if k else '—'} | "
                   f"{k.owner if k else '—'} | {(k.fixed_in or 'not fixed') if k else '—'} | "
                   + ", ".join(f"[#{n}](#finding-{n})" for n in g.findings) + f" | {g.count} |")
    return out


def _nature(k: KnownIssue) -> str:
    """``bug``, or ``documented limitation`` (DeepSpeed says so in its own test or log line)."""
    return "documented limitation" if k.limitation else "bug"


def _known(f: FindingEntry) -> list[str]:
    if f.harness_error:
        return [f"Harness error (zerostate's own failure, not DeepSpeed's): {f.harness_error}.", ""]
    k = f.known_issue
    if k:
        fixed = f"first fixed in {k.fixed_in}" if k.fixed_in else "not fixed in any release"
        patch = f" Proposed fix: {k.upstream_patch}" if k.upstream_patch else ""
        cites = f" DeepSpeed documents it: {k.cites}." if k.cites else ""
        return [f"Known {_nature(k)} `{k.id}` ({k.owner}; {fixed}): {k.title}.{patch}{cites}", ""]
    return ["New: no known issue explains this finding.", ""] if f.labels is not None else []


def _result(r: str) -> str:
    return {"violated": "**violated**", "not exercised": "_not exercised_"}.get(r, r)


def _cell(v: Json) -> str:
    return f"`{v}`" if isinstance(v, str) and " " in v and v.startswith("zerostate") else str(v)


__all__ = ["render_markdown"]
