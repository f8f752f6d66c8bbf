"""The fault-injection table (markdown) and its figures, from the benchmark's per-fault results."""

from __future__ import annotations

from typing import Any


def summary(results: list[dict[str, Any]], fast_s: float) -> dict[str, Any]:
    """Kill rate over the non-equivalent faults: those not argued CPU-blind, plus any argued so and killed
    anyway (the argument was wrong)."""
    killed = [r for r in results if r["status"] == "killed"]
    counted = [r for r in results if not r["cpu_blind"] or r["status"] == "killed"]
    counted_killed = [r for r in counted if r["status"] == "killed"]
    fast = [r for r in counted_killed if r["killer"]["seconds"] < fast_s]
    hidden = [r for r in counted_killed if r["hidden_by_label"]]
    made = [r for r in counted_killed if r.get("rule") == "introduced"]
    gone = [r for r in counted_killed if r.get("rule") == "fixed"]
    grew = [r for r in counted_killed if r.get("rule") == "memory"]
    rate = len(counted_killed) / len(counted) if counted else 0.0
    fast_rate = len(fast) / len(counted) if counted else 0.0
    sentence = (f"{len(results)} faults: {len(killed)} killed, "
                f"{sum(r['status'] == 'survived' for r in results)} survived, "
                f"{sum(r['status'] == 'tool-error' for r in results)} tool error only; "
                f"{len(results) - len(counted)} argued equivalent (CPU-blind). Kill rate over the "
                f"{len(counted)} non-equivalent: {len(counted_killed)}/{len(counted)} = {rate:.0%}; "
                f"within {fast_s:.0f} s: {len(fast)}/{len(counted)} = {fast_rate:.0%}; "
                f"{len(made)} of the kills by an old key's example the fault made fail (introduced), "
                f"{len(gone)} by an example failing on the release that the fault made pass (fixed; without "
                f"them {len(counted_killed) - len(gone)}/{len(counted)}), "
                f"{len(grew)} by a gathered-parameter peak the fault raised (memory); "
                f"{len(hidden)} of the kills carry a known-issue label the unfaulted run also has")
    recorded = [r for r in results if "new_labels" in r]
    mislabelled = [r["id"] for r in recorded if r.get("wrong_labels")]
    replayed = sum("label_replays" in r for r in recorded)
    sentence += (f"; labels of the findings faults introduced: {len(mislabelled)} of {len(recorded)} faults with "
                 f"such a finding labelled by another known issue than the one they reintroduce"
                 + (f" ({', '.join(mislabelled)})" if mislabelled else "")
                 + f" (for {replayed} of them each such label replayed on the unfaulted tree, and cleared where the "
                   "release shows it on the finding's own scenario)")
    unjudged = sum(r["status"] == "unjudged" for r in results)
    if unjudged:  # a kept kill whose killing key a newer unfaulted run also shows: unknown, so not a kill
        sentence += (f"; {unjudged} kept kill(s) not judged again against the newer unfaulted run "
                     "(counted as not killed)")
    earlier = sorted({r["measured"] for r in results if r.get("measured")})
    if earlier:
        kept = sum(bool(r.get("measured")) for r in results)
        sentence += f"; {kept} of the {len(results)} results kept from an earlier run ({'; '.join(earlier)})"
    return {"faults": len(results), "killed": len(killed), "non_equivalent": len(counted),
            "killed_non_equivalent": len(counted_killed), "kill_rate": round(rate, 4),
            "killed_within_fast_s": len(fast), "fast_kill_rate": round(fast_rate, 4),
            "hidden_by_label": len(hidden), "introduced": len(made), "fixed": len(gone), "memory": len(grew),
            "unjudged": unjudged, "sentence": sentence}


def fault_lines(original: str, source: str) -> range:
    """The line numbers (1-based) the fault's original text spans in ``source``."""
    start = source.count("\n", 0, source.index(original)) + 1
    return range(start, start + max(1, original.count("\n")))


def reached(lines: range, covered: set[int]) -> bool:
    """Whether a run executed any of ``lines`` (coverage.py's arcs: an arc's ends are the lines it ran)."""
    return any(n in covered for n in lines)


def _first_line(text: str, width: int = 90) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = line.replace("|", "\\|")
    return line if len(line) <= width else line[: width - 3] + "..."


def _replays(r: dict[str, Any]) -> str:
    reps = r.get("replays") or {}
    if not reps:
        return ""
    faulted, unfaulted = reps.get("faulted", {}), reps.get("unfaulted", {})

    def word(a: dict[str, Any], fail: str, ok: str) -> str:
        if "passed" not in a:
            return "error"
        return fail if a["passed"] is False and a.get("same_key") else (ok if a["passed"] else "other key")

    if r.get("rule") == "memory":  # measured again: the gathered-parameter peak on each tree
        def peak(a: dict[str, Any]) -> str:
            g = a.get("gathered")
            return f"peak {g['peak_elements']}" if isinstance(g, dict) else "unmeasured"
        return f"{peak(faulted)} / {peak(unfaulted)}"
    if r.get("rule") == "fixed":  # the finding is the unfaulted tree's; the fault made the example pass
        return f"{word(faulted, 'SHOWN', 'passes')} / {word(unfaulted, 'fails', 'not reproduced')}"
    return f"{word(faulted, 'reproduced', 'not reproduced')} / {word(unfaulted, 'SHOWN', 'clean')}"


def _reached(r: dict[str, Any]) -> str:
    value = r.get("line_reached")
    return "" if value is None else ("yes" if value else "**no**")


def _new_labels(r: dict[str, Any]) -> str:
    """The labels the fault's new findings carry: "none" for unlabelled ones, **WRONG** for a label that is not
    the issue the fault reintroduces (a fault read as known)."""
    if "new_labels" not in r:
        return "(not recorded)"
    labels = sorted({x["label"] or "none" for x in r["new_labels"]})
    wrong = {x["label"] for x in r.get("wrong_labels") or ()}
    own = {x["label"] for x in r.get("label_replays") or () if x.get("shown_unfaulted")} - wrong
    changed = sorted({f"{x['first_label'] or 'none'} while unshrunk" for x in r["new_labels"] if "first_label" in x})
    cell = ", ".join(f"**WRONG: {lab}**" if lab in wrong else f"{lab} (the release's own: shown unfaulted)"
                     if lab in own else lab for lab in labels) or "no new finding"
    return cell + (f" (first seen labelled {', '.join(changed)}; the finished report's label is shown)" if changed
                   else "")


def markdown(results: list[dict[str, Any]], figures: dict[str, Any], meta: dict[str, Any]) -> str:
    budget = "default budget" if meta["examples"] is None else f"--examples {meta['examples']}"
    seed = "default seed" if meta["seed"] is None else f"--seed {meta['seed']}"
    cut = ("" if not meta.get("cut_s")
           else f", each faulted run cut at {meta['cut_s']:.0f} s of exploring without a kill")
    lines = [
        "# Fault injection: the generated table",
        "",
        (f"Generated by `python benchmarks/bench_faults.py` (DeepSpeed {meta['release']}, {budget}, {seed}{cut}); "
         "the rule, the catalogue and the equivalence arguments are in [faults.md](faults.md)."),
        "",
        f"**{figures['sentence']}.**",
        "",
        ("| fault | area | verdict | killing finding | known-issue label | s to it | runs by then | "
         "replay faulted / unfaulted | faulted line run (coverage run) | labels its new findings carry |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        k = r.get("killer")
        verdict = r["status"] + (" (CPU-blind)" if r["cpu_blind"] else "") + (
            " (introduced: old key)" if r.get("rule") == "introduced" else
            " (fixed: an example failing on the release passes)" if r.get("rule") == "fixed" else
            " (memory: a gathered-parameter peak raised)" if r.get("rule") == "memory" else "") + (
            f" (earlier run: {r['measured']})" if r.get("measured") else "")
        if k:
            label = (k.get("known_issue") or "none") + (" (also in unfaulted run)" if r["hidden_by_label"] else "")
            lines.append(f"| `{r['id']}` | {r['area']} | {verdict} | `{k['key']}`: {_first_line(k['error'], 70)} | "
                         f"{label} | {k['seconds']:.1f} | {k.get('examples') or ''} | {_replays(r)} | {_reached(r)} | "
                         f"{_new_labels(r)} |")
        else:
            tools = ", ".join(r.get("tool_errors") or [])
            what = f"tool errors only: {tools}" if tools else "no new key"
            cut = r["run"].get("cut_s")
            whole = f"run cut at {cut:.0f} s" if cut else "whole run"
            lines.append(f"| `{r['id']}` | {r['area']} | {verdict} | {what} | | | "
                         f"{r['run'].get('examples_run') or ''} ({whole}) | | {_reached(r)} | {_new_labels(r)} |")
    lines.append("")
    return "\n".join(lines)


__all__ = ["fault_lines", "markdown", "reached", "summary"]
