"""The report of ``zerostate watch``: the per-engine files of every rank merged into one report folder.

Same folder layout and top-level keys as every other report (docs/report-format.md): ``report.json`` /
``report.md`` rewritten atomically, ``trace_<n>.svg`` per finding.  What is particular to watch (the
job has no scenario, so no ``finding_<n>.json``, replay or repro): each finding carries ``rank``,
``step``, ``backward``, ``count``, ``modules`` / ``params`` (the user's names), ``explanation`` (the
known issue: id, title, ``fixed_in``, ``runtime_prevents``) and the top level a ``memory`` section and
``memory.svg`` (gathered parameter elements over one train step).  docs/watch.md has the details.
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


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def rank_files(ranks_dir: str) -> list[dict[str, Any]]:
    out = [d for d in (_load(p) for p in sorted(glob.glob(os.path.join(ranks_dir, "rank*.json")))) if d]
    return sorted(out, key=lambda d: (d.get("rank", 0), d.get("pid", 0), d.get("engine", 0)))


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
          runtime: bool = False) -> dict[str, Any]:
    """The merged report.  ``processes``: the processes' records (`zerostate.watcher.process`): what was not
    watched, and crashes outside the engine calls, come from them; ``runtime``: ``--runtime`` was asked for."""
    processes = processes or []
    crashed = observed.crashes(engines, processes, exit_status)
    versions = sorted({e["deepspeed"] for e in engines} | {p["deepspeed"] for p in processes if p.get("deepspeed")})
    column = f"deepspeed {', '.join(versions) or '?'}"
    stage = max((e.get("stage", 0) for e in engines), default=0)
    specs = {sid: {"sentence": s.sentence, "family": s.family,
                   "results": {column: ("ok" if engines and (s.family == "hooks" or stage == 3) else "not checked")},
                   "findings": []}
             for sid, s in SPECS.items()}
    findings: list[dict[str, Any]] = []
    sources = [(e, v) for e in engines for v in e.get("violations", [])]
    sources += [({"deepspeed": c.get("deepspeed") or "?", "rank": c["rank"], "pid": c["pid"], "stage": stage},
                 dict(c, explanation=_explain_crash(c, stage))) for c in crashed]
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
            "explanation": v.get("explanation"), "evidence": v.get("evidence"), "violation_event": idx,
            "events_around": [{"index": j, "event": s, "violation": j == idx} for j, s in v.get("events", [])
                              if idx is None or abs(j - idx) <= 8][-17:],
            "files": {}, "notes": [], "_events": v.get("events", [])})
    steps = max((e.get("steps", 0) for e in engines), default=0)
    backwards = max((e.get("backwards", 0) for e in engines), default=0)
    nv = len(findings)
    line = f"{nv} violation{'s' if nv != 1 else ''} in {backwards} backwards, {steps} steps"
    trouble = observed.problems(engines, processes, status, exit_status, runtime)
    if trouble:
        many = "s" if len(trouble) != 1 else ""
        line = (f"{trouble[0]} -- {line}" if trouble[0].startswith(observed.NO_ENGINE)
                else f"{line}; NOT OBSERVED: {len(trouble)} problem{many} (see the report)")
    return {
        "format": FORMAT, "zerostate": __version__, "command": "watch", "status": status,
        "run": {"target": "deepspeed (your job)", "deepspeed": ", ".join(versions) or None,
                "ranks": sorted({e["rank"] for e in engines}), "engines": len(engines),
                "runtime": any(e.get("runtime") for e in engines), "exit_status": exit_status,
                "started": started, "seconds": round(seconds, 2), "command_line": " ".join(command)},
        "columns": [column], "specs": specs, "findings": findings,
        "memory": {_memory_label(e): e.get("memory", {}) for e in engines},
        "hung": hung,
        "not_observed": trouble, "not_checked": observed.not_checked(engines),
        "configuration": observed.configuration(engines),
        "processes": [{k: p.get(k) for k in ("pid", "rank", "argv", "deepspeed", "engines_built", "engines_watched",
                                             "ended")} for p in processes],
        "summary": {"violations": nv, "backwards": backwards, "steps": steps, "exit_status": exit_status,
                    "watched": bool(engines), "not_observed": len(trouble)},
        "summary_text": line,
    }


def _memory_label(e: dict[str, Any]) -> str:
    return f"rank {e['rank']}" + (f" engine {e['engine']}" if e.get("engine", 1) > 1 else "")


def _explain_crash(crash: dict[str, Any], stage: int) -> dict[str, Any] | None:
    """The known issue that explains a crash outside the engine calls, by its exception (known/watch.py)."""
    from zerostate.known.watch import explain
    e = explain("exception", crash.get("deepspeed"), {"error": crash["message"], "stage": stage})
    return e.to_dict() if e is not None else None


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
    for key, label in (("command_line", "command"), ("deepspeed", "DeepSpeed release"), ("ranks", "ranks"),
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
    out += ["", f"**{d['summary_text']}**", "", "## Specs", "",
            "| spec | " + " | ".join(d["columns"]) + " | findings |", "|---" * (len(d["columns"]) + 2) + "|"]
    for sid, row in d["specs"].items():
        cells = [{"violated": "**violated**"}.get(r, r) for r in (row["results"].get(c, "not checked")
                                                                   for c in d["columns"])]
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
        else:
            out += ["No known issue explains it: a new finding, or a gap in the watcher (see docs/watch.md).", ""]
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


__all__ = ["build", "hung_stacks", "memory_svg", "now", "rank_files", "render_markdown", "write"]
