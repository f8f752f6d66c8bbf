"""A `Diagnosis` as the doctor prints it (text) and as ``--json`` writes it."""

from __future__ import annotations

from typing import Any

from zerostate.doctor.diagnose import Diagnosis, Entry, Need
from zerostate.doctor.dimensions import BY_NAME, DIMENSIONS, Kind
from zerostate.known.issue import Nature


def _need(n: Need) -> str:
    return f"{n.says()} ({n.fact.source})"


def _range(e: Entry) -> str:
    lo, hi = (".".join(map(str, r)) for r in e.issue.releases)
    kind = "documented limitation" if e.issue.nature is Nature.LIMITATION else "bug"
    fixed = f", fixed in {e.issue.fixed_in}" if e.issue.fixed_in else ", no release fixes it yet"
    return f"{kind}; seen on {lo} up to before {hi}{fixed}"


def text(d: Diagnosis, replays: dict[str, str] | None = None) -> str:
    s = d.setup
    lines = [f"zerostate doctor: DeepSpeed {d.release}; {d.checked} known DeepSpeed issue(s) of this release checked"]
    if d.newer_than_table:
        lines.append(f"  DeepSpeed {d.release} is newer than every release the table was established on: the issues "
                     "no release is known to fix are judged as if present, each marked \"not established\"")
    said = [name if f.value is True else f"{name}={f.value}" for name, f in s.facts.items()
            if f.value is not None and (f.value != BY_NAME[name].neutral or BY_NAME[name].neutral is None)]
    lines.append("your setup, as read: " + (", ".join(said) if said else "nothing beyond the neutral values") +
                 " (`zerostate doctor --dimensions` says what each name means; --json gives where each was read)")
    if not d.entries:
        lines.append(f"no known issue of DeepSpeed {d.release} is in the family of this setup.  That is not proof it "
                     "is safe: unknown bugs are unknown, and the conditions below were not said -- run the job under "
                     "`zerostate watch` to see what it does.")
    else:
        full = sum(1 for e in d.entries if not e.match.unsaid)
        lines.append(f"may be hit: {len(d.entries)} known issue(s) of DeepSpeed {d.release} have a repro whose setup "
                     f"yours matches ({full} on every point, {len(d.entries) - full} on what was said); \"may\": a "
                     "repro's setup is not your job -- `zerostate watch` shows whether the job meets it")
        for e in d.entries:
            lines.append(f"  {e.issue.id}: {e.issue.title}")
            lines.append(f"    {_range(e)}" + ("" if e.established else "; not established on this release"))
            if e.match.met:
                lines.append(f"    your setup has what {e.match.which} has: " +
                             "; ".join(_need(n) for n in e.match.met))
            if e.match.unsaid:
                lines.append("    and it needs, which no input said: " + "; ".join(n.says() for n in e.match.unsaid))
            if e.avoid:
                lines.append("    avoided by: " + "; ".join(e.avoid))
            if e.leaves_family:
                lines.append("    changes no repro of it survives (each leaves its family; not tested as "
                             "workarounds): " + "; ".join(e.leaves_family))
            if replays and e.issue.id in replays:
                lines.append(f"    replay: {replays[e.issue.id]}")
    if d.elsewhere:
        lines.append(f"in the family on other releases only: {len(d.elsewhere)} issue(s) (fixed before "
                     f"{d.release} or not yet in it; not named here)")
    unsaid = [dim for dim in DIMENSIONS if s.fact(dim.name).value is None]
    if unsaid:
        loop = [dim.name for dim in unsaid if dim.kind is Kind.LOOP]
        rest = [dim.name for dim in unsaid if dim.kind is not Kind.LOOP]
        lines.append("not said (each may bring issues into or out of the family; say it with --set NAME=true|false or "
                     "the model options): " + ", ".join(rest + loop))
    for note in s.notes:
        lines.append(f"note: {note}")
    if d.entries and replays is None:
        lines.append("--replay runs each issue's nearest repro on this release in a fresh worker")
    return "\n".join(lines)


def as_json(d: Diagnosis, replays: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "deepspeed": d.release,
        "checked": d.checked,
        "newer_than_table": d.newer_than_table,
        "setup": {name: {"value": f.value, "source": f.source} for name, f in d.setup.facts.items()},
        "not_said": [dim.name for dim in DIMENSIONS if d.setup.fact(dim.name).value is None],
        "notes": list(d.setup.notes),
        "may_be_hit": [{
            "id": e.issue.id, "title": e.issue.title, "nature": e.issue.nature.value, "fixed_in": e.issue.fixed_in,
            "established": e.established, "repro": e.match.which, "scenario": e.match.repro.to_dict(),
            "has": [{"dimension": n.dimension, "value": n.value, "source": n.fact.source} for n in e.match.met],
            "needs_unsaid": [{"dimension": n.dimension, "value": n.value} for n in e.match.unsaid],
            "avoided_by": list(e.avoid), "leaves_family": list(e.leaves_family),
            **({"replay": replays[e.issue.id]} if replays and e.issue.id in replays else {}),
        } for e in d.entries],
        "in_family_on_other_releases": list(d.elsewhere),
    }


__all__ = ["as_json", "text"]
