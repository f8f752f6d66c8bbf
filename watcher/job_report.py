"""The report of ``zerostate watch``: the per-engine files of every rank merged into one report folder.

Same folder layout and top-level keys as every other report (docs/report-format.md): ``report.json`` /
``report.md`` rewritten atomically, ``trace_<n>.svg`` per finding.  What is particular to watch (the
job has no scenario, so no ``finding_<n>.json``, replay or repro): each finding carries ``rank``,
``step``, ``backward``, ``count``, ``modules`` / ``params`` (the user's names), ``known_issue`` (`known.labels.label`,
as explore's reports) and ``explanation`` (the same with the issue's ``runtime_prevents`` and detail); the top level
``ranks`` (each rank of the job's world size: watched or not, its backwards and steps), ``job_crashes`` (exceptions
the job's own code raised: not findings, never labelled), a ``memory`` section and ``memory.svg`` (gathered parameter
elements over one train step).  Each spec reads ``ok`` only when an event exercised it (``not observed`` otherwise).
docs/watch.md has the details.
"""

from __future__ import annotations

import datetime as _dt
import glob
import json
import os
from typing import Any

from zerostate import __version__
from zerostate.model.events import Event, EventKind
from zerostate.specs import SPECS

from zerostate.atomic import replace_file
from zerostate.watcher import observed

FORMAT = 1


def rank_files(ranks_dir: str) -> list[dict[str, Any]]:
    """Every readable per-engine file (`read_rank_files` says which could not be read)."""
    return read_rank_files(ranks_dir)[0]


def read_rank_files(ranks_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(every per-engine file ``rank<r>-<pid>-<n>.json``, by rank; each that could not be read: ``{"file", "why"}``).
    The files are replaced atomically: one that cannot be read is lost, not being written."""
    out, bad = [], []
    for p in sorted(glob.glob(os.path.join(ranks_dir, "rank*.json"))):
        try:
            with open(p, encoding="utf-8") as fh:
                d = json.load(fh)
            if not isinstance(d, dict) or not isinstance(d.get("rank"), int):
                raise ValueError("not a watch file (no rank)")
            out.append(d)
        except (OSError, ValueError) as exc:
            bad.append({"file": os.path.basename(p), "why": f"{type(exc).__name__}: {exc}"})
    out.sort(key=lambda d: (d.get("rank", 0), d.get("pid", 0), d.get("engine", 0)))
    return out, bad


def hung_stacks(ranks_dir: str) -> list[dict[str, Any]]:
    """``rank<r>-<pid>.stack`` files with a dumped stack (a header line alone means the call returned)."""
    out = []
    for p in sorted(glob.glob(os.path.join(ranks_dir, "rank*.stack"))):
        try:
            with open(p, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        if text.count("\n") > 1:
            rank = os.path.basename(p)[4:].split("-", 1)[0]
            out.append({"rank": int(rank) if rank.isdigit() else rank, "stack": text[-8000:]})
    return out


def build(engines: list[dict[str, Any]], hung: list[dict[str, Any]], command: list[str], status: str,
          exit_status: int | None, started: str, seconds: float, processes: list[dict[str, Any]] | None = None,
          runtime: bool = False, launcher_world: int | None = None,
          unreadable: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The merged report.  ``processes``: the processes' records (`zerostate.watcher.process`): what was not
    watched, and crashes outside the engine calls, come from them; ``runtime``: ``--runtime`` was asked for;
    ``launcher_world``: the world size the launcher's command line gives (`zerostate.watcher.job_launch`), used when no
    rank saw one; ``unreadable``: the watch files that could not be read, and why."""
    processes = processes or []
    unreadable = unreadable or []
    crashed = observed.crashes(engines, processes, exit_status)
    versions = sorted({e["deepspeed"] for e in engines} | {p["deepspeed"] for p in processes if p.get("deepspeed")})
    column = f"deepspeed {', '.join(versions) or '?'}"
    stage = max((e.get("stage", 0) for e in engines), default=0)
    results = observed.spec_results(engines)
    specs = {sid: {"sentence": s.sentence, "family": s.family, "results": {column: results[sid]}, "findings": []}
             for sid, s in SPECS.items()}
    findings: list[dict[str, Any]] = []
    sources = [(e, v) for e in engines for v in e.get("violations", []) if not v.get("job_crash")]
    sources += [({"deepspeed": c.get("deepspeed") or "?", "rank": c["rank"], "pid": c["pid"], "stage": stage}, c)
                for c in crashed if not c.get("job_crash")]
    for e, v in sources:
        n = len(findings) + 1
        check = v["spec"]
        row: dict[str, Any] = specs.setdefault(check, {"sentence": "the job raised (DeepSpeed or torch inside it)",
                                       "family": "oracle", "results": {column: "ok"}, "findings": []})
        row["results"][column] = "violated"
        row["findings"].append(n)
        idx = v.get("event")
        findings.append({
            "n": n, "check": check, "error": v["message"], "design": None,
            "where": f"DeepSpeed {e['deepspeed']}, rank {e['rank']}", "rank": e["rank"], "pid": e.get("pid"),
            "step": v.get("step"), "backward": v.get("backward"), "count": v.get("count", 1),
            "in": v.get("in"), "traceback": v.get("traceback"),
            "modules": v.get("modules", []), "params": v.get("params", []),
            "key": v.get("key"), "group": v.get("group"), "origin": v.get("origin"),
            "known_issue": v.get("known_issue"), "explanation": v.get("explanation"),
            "harness_error": v.get("harness_error"), "label_error": v.get("label_error"),
            "evidence": v.get("evidence"), "violation_event": idx,
            "events_around": [{"index": j, "event": s, "violation": j == idx} for j, s in v.get("events", [])
                              if idx is None or abs(j - idx) <= 8][-17:],
            "files": {}, "notes": [], "_events": v.get("events", [])})
    job_crashes = [_job_crash(e.get("deepspeed"), dict(e["job_crash"], pid=e.get("pid")))
                   for e in engines if e.get("job_crash")]
    job_crashes += [_job_crash(c.get("deepspeed"), c) for c in crashed if c.get("job_crash")]
    for k, c in enumerate(job_crashes, 1):
        c["n"] = k
    world = observed.world_size(engines, processes, launcher_world)
    per_rank = observed.ranks(engines, world)
    watched = [r["rank"] for r in per_rank if r["watched"]]
    steps = max((r["steps"] for r in per_rank), default=0)
    backwards = max((r["backwards"] for r in per_rank), default=0)
    nv = len(findings)
    line = f"{nv} violation{'s' if nv != 1 else ''} in {backwards} backwards, {steps} steps"
    if engines and (len(per_rank) > 1 or len(watched) != len(per_rank)):
        line += f" on {len(watched)} of {len(per_rank)} ranks"
    trouble = (observed.problems(engines, processes, status, exit_status, runtime)
               + observed.unwatched_ranks(engines, processes, world, unreadable, status)
               + observed.unexercised_specs(engines, results, status))
    if job_crashes:
        c = job_crashes[0]
        line += f"; the job's own code raised {c['error'][:200]} (rank {c['rank']})"
    if trouble:
        many = "s" if len(trouble) != 1 else ""
        line = (f"{trouble[0]} -- {line}" if trouble[0].startswith(observed.NO_ENGINE)
                else f"{line}; NOT OBSERVED: {len(trouble)} problem{many} (see the report)")
    not_observed_specs = [sid for sid, r in results.items() if r == observed.NOT_OBSERVED]
    return {
        "format": FORMAT, "zerostate": __version__, "command": "watch", "status": status,
        "run": {"target": "deepspeed (your job)", "deepspeed": ", ".join(versions) or None,
                "ranks": sorted({e["rank"] for e in engines}), "world_size": world, "engines": len(engines),
                "runtime": any(e.get("runtime") for e in engines), "exit_status": exit_status,
                "started": started, "seconds": round(seconds, 2), "command_line": " ".join(command)},
        "columns": [column], "specs": specs, "findings": findings, "job_crashes": job_crashes,
        "ranks": per_rank,
        "memory": {_memory_label(e): e.get("memory", {}) for e in engines},
        "hung": hung,
        "not_observed": trouble, "not_checked": observed.not_checked(engines),
        "configuration": observed.configuration(engines),
        "processes": [{k: p.get(k) for k in ("pid", "rank", "argv", "deepspeed", "engines_built", "engines_watched",
                                             "ended")} for p in processes],
        "summary": {"violations": nv, "backwards": backwards, "steps": steps, "exit_status": exit_status,
                    "watched": bool(engines), "not_observed": len(trouble), "world_size": world,
                    "ranks_watched": watched, "ranks_not_watched": [r["rank"] for r in per_rank if not r["watched"]],
                    "specs_not_observed": not_observed_specs if engines else sorted(SPECS),
                    "job_crashes": len(job_crashes)},
        "summary_text": line,
    }


def _job_crash(version: str | None, c: dict[str, Any]) -> dict[str, Any]:
    """An exception the job's own code raised (`zerostate.watcher.judge.raised_by_the_job`): the job's crash, reported
    apart from the findings about DeepSpeed and never labelled."""
    return {"n": 0, "error": c["message"], "rank": c.get("rank"), "pid": c.get("pid"), "step": c.get("step"),
            "backward": c.get("backward"), "in": c.get("in"), "where": c.get("where") or None,
            "traceback": c.get("traceback"), "deepspeed": version, "known_issue": None}


def _memory_label(e: dict[str, Any]) -> str:
    return f"rank {e['rank']}" + (f" engine {e['engine']}" if e.get("engine", 1) > 1 else "")


def write(out_dir: str, data: dict[str, Any], pictures: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)
    if pictures:
        _pictures(out_dir, data)
    for f in data["findings"]:
        f.pop("_events", None)
    replace_file(os.path.join(out_dir, "report.json"), json.dumps(data, indent=2, default=str) + "\n")
    replace_file(os.path.join(out_dir, "report.md"), render_markdown(data))


def _pictures(out_dir: str, data: dict[str, Any]) -> None:
    for f in data["findings"]:
        evs: list[Event] = []
        vi = None
        for j, s in f.get("_events") or []:
            ev = _parse(s)
            if ev is None:
                continue
            if j == f["violation_event"]:
                vi = len(evs)
            evs.append(ev)
        if not evs:
            continue
        try:
            from zerostate.reports import trace_picture as pictures
            canvas = pictures.trace_picture(evs, vi, f"{f['check']} violated ({f['where']})", f["error"])
            for k, name in pictures.write_picture(canvas, os.path.join(out_dir, f"trace_{f['n']}")).items():
                f["files"][f"trace_{k}"] = name
        except Exception as exc:  # noqa: BLE001 - a report must survive a picture bug; say so
            f["notes"].append(f"trace picture not drawn: {type(exc).__name__}: {exc}")
    for label, mem in data["memory"].items():
        series = mem.get("series") or []
        if len(series) >= 2:
            name = "memory.svg" if not data.get("memory_files") else f"memory_{len(data['memory_files'])}.svg"
            replace_file(os.path.join(out_dir, name), memory_svg(series, f"{label}: gathered parameter elements "
                                                                 f"over train step {mem.get('series_step')}"))
            data.setdefault("memory_files", {})[label] = name


def _parse(s: str) -> Event | None:
    """An event back from its ``str()`` (``kind k=v ...``; names hold no spaces)."""
    parts = s.split()
    try:
        kw: dict[str, Any] = {}
        for p in parts[1:]:
            k, v = p.split("=", 1)
            kw[k] = int(v) if k in ("task", "value") and v.lstrip("-").isdigit() else v
        return Event(EventKind(parts[0]), **kw)
    except (ValueError, TypeError, IndexError):
        return None


def memory_svg(series: list, title: str) -> str:
    """A step plot of gathered elements against event index; forward / backward / recompute / step marked."""
    W, H, L, T, B = 900, 320, 70, 40, 40
    xs = [p[0] for p in series]
    ys = [p[1] for p in series]
    x0, x1 = min(xs), max(xs) or 1
    ymax = max(ys) or 1
    sx = lambda x: L + (x - x0) * (W - L - 20) / max(1, x1 - x0)  # noqa: E731
    sy = lambda y: H - B - y * (H - T - B) / ymax  # noqa: E731
    pts, prev = [], None
    for x, y, _ in series:
        if prev is not None:
            pts.append(f"{sx(x):.1f},{sy(prev):.1f}")
        pts.append(f"{sx(x):.1f},{sy(y):.1f}")
        prev = y
    marks = {EventKind.FORWARD_START.value: ("#3a6ea5", "forward"),
             EventKind.USER_BACKWARD_START.value: ("#d9822b", "backward"),
             EventKind.RECOMPUTE_START.value: ("#8e44ad", "recompute"), EventKind.STEP.value: ("#555", "step")}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{L}" y="20" font-size="13">{_esc(title)}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="#000"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="#000"/>',
           f'<text x="{L - 5}" y="{sy(ymax) + 4:.1f}" text-anchor="end">{ymax}</text>',
           f'<text x="{L - 5}" y="{H - B + 4}" text-anchor="end">0</text>',
           f'<text x="{(L + W) / 2:.0f}" y="{H - 10}" text-anchor="middle">event index (peak {ymax} elements)</text>']
    seen = set()
    for x, _, kind in series:
        if kind in marks:
            colour, label = marks[kind]
            out.append(f'<line x1="{sx(x):.1f}" y1="{T}" x2="{sx(x):.1f}" y2="{H - B}" stroke="{colour}" '
                       f'stroke-dasharray="3,3"/>')
            if (kind, label) not in seen:
                seen.add((kind, label))
                out.append(f'<text x="{sx(x) + 3:.1f}" y="{T + 12 * len(seen)}" fill="{colour}">{label}</text>')
    out.append(f'<polyline fill="none" stroke="#2a9d4b" stroke-width="1.5" points="{" ".join(pts)}"/>')
    return "\n".join(out + ["</svg>"]) + "\n"


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render_markdown(d: dict[str, Any]) -> str:
    run = d["run"]
    out = ["# zerostate watch report", ""]
    if d["status"] != "complete":
        out += [f"**Status: {d['status']}** — this report holds every violation seen so far.", ""]
    out += ["| | |", "|---|---|"]
    for key, label in (("command_line", "command"), ("deepspeed", "DeepSpeed release"), ("ranks", "ranks watched"),
                       ("world_size", "world size"),
                       ("runtime", "zerostate.runtime installed"), ("exit_status", "exit status"),
                       ("started", "started (UTC)"), ("seconds", "seconds")):
        if run.get(key) is not None:
            out.append(f"| {label} | `{run[key]}` |" if key == "command_line" else f"| {label} | {run[key]} |")
    if d.get("not_observed"):
        out += ["", "## NOT OBSERVED: what the watch could not check", ""]
        out += [f"- **{p}**" for p in d["not_observed"]]
    conf = d.get("configuration") or {}
    if conf.get("zero_stage") is not None:
        out += ["", (f"What the job ran: ZeRO-{conf['zero_stage']}, activation checkpointing "
                    f"{conf['activation_checkpointing']} (as the trainer left it).")]
        if conf.get("checkpointing_switched"):
            out += ["", conf["checkpointing_switched"].capitalize() + "."]
    if d.get("not_checked"):
        out += ["", "Not checked in this job:", ""] + [f"- {n}" for n in d["not_checked"]]
    out += ["", f"**{d['summary_text']}**", ""]
    if d.get("ranks"):
        out += ["## Ranks", "", "| rank | watched | engines | backwards | steps | events folded |",
                "|---|---|---|---|---|---|"]
        for r in d["ranks"]:
            out.append(f"| {r['rank']} | {'yes' if r['watched'] else '**no: not observed**'} | {r['engines']} | "
                       f"{r['backwards']} | {r['steps']} | {r['events']} |")
        out.append("")
    if d.get("job_crashes"):
        out += ["## The job's own crash", "",
                ("Raised in your code (no DeepSpeed frame between your code and the raise): the job's crash, not a "
                 "finding about DeepSpeed, and never labelled with a known DeepSpeed issue."), ""]
        for c in d["job_crashes"]:
            at = f" at {c['where']}" if c.get("where") else ""
            out += [f"- rank {c['rank']} (pid {c['pid']}), train step {c['step']}{at}, {c.get('in') or ''}:", "",
                    "  ```text", *("  " + ln for ln in (c.get("traceback") or c["error"]).rstrip().splitlines()),
                    "  ```", ""]
    out += ["## Specs", "", "A spec reads ok only when an event of some rank exercised it; `not observed`: none did.",
            "", "| spec | " + " | ".join(d["columns"]) + " | findings |", "|---" * (len(d["columns"]) + 2) + "|"]
    for sid, row in d["specs"].items():
        cells = [{"violated": "**violated**", "not observed": "**not observed**"}.get(r, r)
                 for r in (row["results"].get(c, "not checked") for c in d["columns"])]
        found = ", ".join(f"[#{n}](#finding-{n})" for n in row["findings"]) or "—"
        out.append(f"| `{sid}` | " + " | ".join(cells) + f" | {found} |")
    out += ["", "## Memory (ZeRO-3)", ""]
    for label, mem in d["memory"].items():
        peaks = mem.get("gathered_peak_per_backward") or []
        ags = mem.get("allgathers_per_step") or []
        out.append(f"- {label}: gathered-parameter peak {mem.get('gathered_peak', 0)} elements; per backward "
                   f"{_short(peaks)}; all-gathers per step {_short(ags)}")
        if d.get("memory_files", {}).get(label):
            out.append(f"\n  ![gathered elements]({d['memory_files'][label]})")
    if d.get("hung"):
        out += ["", "## Ranks that did not return from an engine call", ""]
        for h in d["hung"]:
            out += [f"Rank {h['rank']}:", "", "```text", h["stack"].rstrip(), "```", ""]
    out += ["", f"## Findings ({len(d['findings'])})", ""]
    if not d["findings"]:
        out += ["None.", ""]
    else:
        out += ["| # | check | rank | train step | known issue |", "|---|---|---|---|---|"]
        for f in d["findings"]:
            k = f.get("known_issue")
            out.append(f"| [{f['n']}](#finding-{f['n']}) | `{f['check']}` | {f['rank']} | {f['step']} | "
                       + (f"`{k['id']}`" if k else ("zerostate's own failure" if f.get("harness_error") else "—"))
                       + " |")
        out.append("")
    for f in d["findings"]:
        out += [f'<a id="finding-{f["n"]}"></a>',
                f"### Finding {f['n']}: `{f['check']}` on {f['where']}, train step {f['step']}, backward "
                f"{f['backward']}" + (f" (seen {f['count']} times)" if f.get("count", 1) > 1 else ""), "",
                "```text", f["error"].strip(), "```", ""]
        e = f.get("explanation")
        if e:
            fixed = f"fixed in DeepSpeed {e['fixed_in']}" if e.get("fixed_in") else "not fixed as of DeepSpeed 0.19.8"
            prevents = "**prevents it**" if e.get("runtime_prevents") else "does not prevent it"
            out += [(f"Known issue **{e['id']}**: {e['title']} ({fixed}); `zerostate.runtime` {prevents} "
                    "(`zerostate watch --runtime`)."), "", f"> {e['detail']}", ""]
        elif f.get("harness_error"):
            out += [f"Not a DeepSpeed finding: {f['harness_error']} -- a bug in zerostate watch.", ""]
        else:
            out += ["No known issue's evidence matches it: a new finding, or a gap in the watcher (see docs/watch.md).",
                    ""]
        left = (f.get("evidence") or {}).get("left_by_module_without_post_backward")
        if left:
            out += ["Evidence: " + ", ".join(f"`{p}` (pre-backward of `{m}` ran, its post-backward did not)"
                                             for p, m in sorted(left.items())), ""]
        if f.get("params") or f.get("modules"):
            out += [(f"Your model: parameters {', '.join(f'`{p}`' for p in f['params'][:4]) or '—'}; modules "
                    f"{', '.join(f'`{m}`' for m in f['modules'][:4]) or '—'}"), ""]
        if f["events_around"]:
            out += ["Events around the violation (`>>` marks the violating event):", "", "```text"]
            out += [f"{'>>' if e['violation'] else '  '} {e['index']:6d}  {e['event']}" for e in f["events_around"]]
            out += ["```", ""]
        if f.get("traceback"):
            out += ["```text", f["traceback"].rstrip(), "```", ""]
        if "trace_svg" in f["files"]:
            png = f["files"].get("trace_png")
            out.append(f"![event sequence]({f['files']['trace_svg']})" + (f" ([PNG]({png}))" if png else ""))
        out += [f"Note: {n}" for n in f["notes"]] + [""]
    return "\n".join(out) + "\n"


def _short(xs: list) -> str:
    if not xs:
        return "—"
    return ", ".join(map(str, xs[:8])) + (f", ... ({len(xs)} in all)" if len(xs) > 8 else "")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


__all__ = ["build", "hung_stacks", "memory_svg", "now", "rank_files", "read_rank_files", "render_markdown", "write"]
