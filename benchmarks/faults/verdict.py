"""Whether an exploration killed a fault: the rule of docs/faults.md, as a pure function of two reports.

A fault is **killed** by a change ``zerostate diff --base RELEASE --head FAULTED_TREE`` shows a reviewer:
a finding about DeepSpeed (an error of the tool itself -- the oracle raising, an internal error -- never
kills) that is new or that the fault made an example show, an example failing on the release that the fault
made pass, or a raised gathered-parameter peak:

* ``new-key``: its key (check, plus the exception's origin, the spec's violation code, the oracle's known
  issue or the oracle difference's own mechanism) is not among the unfaulted run's keys;
* ``introduced``: its key is one the unfaulted run has, but its own example, replayed in a fresh worker, fails
  its check with that key on the faulted tree and passes that check on the unfaulted tree (`introduced`): the
  fault made that example fail, whatever key the unfaulted run found elsewhere;
* ``fixed``: a generated example failing on the unfaulted tree passes its check on the faulted tree, in
  repeated fresh replays (`fixed`, `changed_examples`' ``lost``);
* ``memory``: a generated example that ran to its end on both trees (ZeRO-3) whose gathered-parameter peak
  the fault raised beyond ``diff``'s default tolerance (`grown_examples`, from both runs' ``examples.jsonl``),
  measured again in a fresh worker on each tree -- a memory regression, which ``diff`` reports per scenario.

The `introduced` candidates are of two sources: the first findings under old keys as the faulted run's report
holds them (`old_key_candidates`: the example it first met the key on, or the one shrinking ended on), and the
generated examples whose run on the faulted tree showed an old key the same example's run on the unfaulted tree
did not (`changed_examples`, read from both runs' ``examples.jsonl``: one seed generates the same examples in
the same order, so only the tree differs).  A faulted run whose only effects are more examples under keys the
unfaulted run has, each failing on the unfaulted tree too (or not replayed: replays are bounded), is not a kill,
whatever their number.  A killing finding may carry a known-issue label that also labels a finding of the
unfaulted run: it is counted apart (``hidden_by_label``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypedDict


TOOL_CHECKS = frozenset({"oracle-error", "internal"})
"""Checks that report the tool failing, not DeepSpeed (the oracle raised; the harness or tracer broke)."""


class SeenFinding(TypedDict):
    """One finding of a run as the benchmark saw it appear in the report."""

    key: str
    check: str
    error: str
    known_issue: str | None
    seconds: float
    """Seconds from the start of the exploration to the report flush that first held it."""
    examples: int | None
    """Distinct runs done by then (the report's ``examples_run``)."""
    n: int


@dataclass
class Verdict:
    status: str
    """killed | survived | tool-error"""
    killer: SeenFinding | None = None
    rule: str = ""
    """What killed it: ``new-key``, ``introduced``, ``fixed`` or ``memory`` (module docstring); "" when not
    killed."""
    hidden_by_label: bool = False
    """The killing finding's known-issue label also labels a finding of the unfaulted run."""
    new_keys: list[str] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)


def new_labels(baseline: list[dict[str, Any]], seen: list[SeenFinding]) -> list[dict[str, Any]]:
    """Each finding a faulted run introduced, with the known-issue label it carries (None: unlabelled)."""
    old = {e["key"] for e in baseline}
    return [{"key": s["key"], "label": s["known_issue"]} for s in seen if s["key"] not in old]


def final_labels(new: list[dict[str, Any]], report: dict[str, Any]) -> list[dict[str, Any]]:
    """``new`` (`new_labels`: each label as the finding was first seen, unshrunk) with the label the finished report
    gives it: what a reader of the report is told.  A key the report no longer holds keeps its first label;
    ``first_label`` records one that changed."""
    entries = {e.get("key"): e for e in report.get("findings", [])}
    out = []
    for x in new:
        entry = entries.get(x["key"])
        final = label_of(entry) if entry is not None else x["label"]
        out.append({**x, "label": final, **({"first_label": x["label"]} if final != x["label"] else {})})
    return out


def is_tool_error(check: str) -> bool:
    return check in TOOL_CHECKS or check.startswith("harness")


def label_of(entry: dict[str, Any]) -> str | None:
    """The known-issue id a report entry carries, if any."""
    known = entry.get("known_issue")
    if isinstance(known, dict):
        return str(known.get("id")) if known.get("id") else None
    return str(known) if known else None


def judge(baseline: list[dict[str, Any]], seen: list[SeenFinding], ignored: frozenset[str] = frozenset(),
          introduced_keys: frozenset[str] = frozenset(), introduced_examples: Sequence[SeenFinding] = (),
          fixed_examples: Sequence[SeenFinding] = (), grown: Sequence[SeenFinding] = ()) -> Verdict:
    """The verdict on a faulted run's findings ``seen`` (in the order they appeared) against the unfaulted
    run's report entries ``baseline``.  ``ignored``: keys a replay on the unfaulted tree showed after all
    (they are not the fault's); ``introduced_keys``: old keys whose finding's replays were `introduced`;
    ``introduced_examples``: generated examples whose replays were (`changed_examples`), each timed by its
    own run; ``fixed_examples``: those whose replays were `fixed` (rule ``fixed``); ``grown``: examples whose
    gathered-parameter peak the fault raised, confirmed (rule ``memory``).  The killer is the earliest killing
    finding of any kind."""
    base_keys = {str(e["key"]) for e in baseline}
    base_labels = {label for label in map(label_of, baseline) if label}
    new = [f for f in seen if f["key"] not in base_keys and f["key"] not in ignored]
    real = [f for f in new if not is_tool_error(f["check"])]
    tools = [f["key"] for f in new if is_tool_error(f["check"])]
    made = [f for f in seen if f["key"] in base_keys and f["key"] in introduced_keys and not is_tool_error(f["check"])]
    made += [f for f in introduced_examples if not is_tool_error(f["check"])]
    lost = [f for f in fixed_examples if not is_tool_error(f["check"])]
    grew = list(grown)
    if real or made or lost or grew:
        killer = min(real + made + lost + grew, key=lambda f: (f["seconds"], f["n"]))
        rule = ("new-key" if killer in real else "introduced" if killer in made else "fixed" if killer in lost
                else "memory")
        return Verdict("killed", killer, rule, bool(killer["known_issue"] and killer["known_issue"] in base_labels),
                       [f["key"] for f in real], tools)
    return Verdict("tool-error" if tools else "survived", None, "", False, [], tools)


def shows(answer: Mapping[str, Any]) -> bool:
    """A replay (``zerostate replay --json``) failed the finding's check with the finding's key."""
    return answer.get("passed") is False and bool(answer.get("same_key"))


def introduced(faulted: Mapping[str, Any], unfaulted: Mapping[str, Any]) -> bool:
    """The fault made this example fail: its replay shows the finding on the faulted tree, and on the unfaulted
    tree the finding's check holds.  A replay that errs, or an unfaulted tree failing the same check under
    another key, is not counted (conservative: it can miss a kill, never make one)."""
    return shows(faulted) and unfaulted.get("passed") is True


def old_key_candidates(baseline: list[dict[str, Any]], seen: list[SeenFinding], limit: int,
                       before_s: float | None = None, report: list[dict[str, Any]] | None = None) -> list[SeenFinding]:
    """The findings worth replaying for `introduced`: the first ``limit`` (in the order they appeared) whose
    key the unfaulted run also has, about DeepSpeed, and (``before_s``) seen before a kill already made.  With
    the faulted run's ``report`` entries, a finding whose example is the very scenario the unfaulted run showed
    that key on is left out: the unfaulted tree already failed it."""
    base_keys = {str(e["key"]) for e in baseline}
    shown_on = {str(b["key"]): b.get("scenario") for b in baseline}
    same = {str(e["key"]) for e in report or ()
            if e.get("scenario") is not None and e.get("scenario") == shown_on.get(str(e.get("key")))}
    old = [f for f in seen if f["key"] in base_keys and f["key"] not in same and not is_tool_error(f["check"])
           and (before_s is None or f["seconds"] < before_s)]
    return sorted(old, key=lambda f: (f["seconds"], f["n"]))[:max(0, limit)]


def same_examples(unfaulted: Sequence[Mapping[str, Any]], faulted: Sequence[Mapping[str, Any]]
                  ) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """``(unfaulted row, faulted row)`` of each generated example both runs ran: the same scenario at the same
    position (``examples.jsonl``), in position order."""
    before = {int(r["position"]): r for r in unfaulted}
    for row in sorted(faulted, key=lambda r: int(r["position"])):
        other = before.get(int(row["position"]))
        if other is not None and other.get("scenario") == row.get("scenario"):
            yield other, row


def changed_examples(unfaulted: Sequence[Mapping[str, Any]], faulted: Sequence[Mapping[str, Any]],
                     baseline: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` generated examples (``examples.jsonl`` rows of both runs, by position) that are the
    same scenario at the same position and whose outcome the fault changed, one per example: ``{"position",
    "seconds", "scenario", "key", "check", "direction"}`` where ``direction`` is

    * ``gained``: the faulted run showed a key about DeepSpeed, one the unfaulted run has somewhere (a new key
      is a kill already), that the same example's unfaulted run did not (its first such key);
    * ``lost``: the unfaulted run showed a key about DeepSpeed that the same example's faulted run did not,
      and the faulted run shows no failure of the tool's own (which could hide it)."""
    base_keys = {str(e["key"]) for e in baseline}
    out: list[dict[str, Any]] = []
    for other, row in same_examples(unfaulted, faulted):
        had = [f for f in other.get("findings", []) if not is_tool_error(str(f["check"]))]
        has = row.get("findings", [])
        keys_had, keys_has = {str(f["key"]) for f in had}, {str(f["key"]) for f in has}
        gained = [f for f in has if str(f["key"]) in base_keys and str(f["key"]) not in keys_had
                  and not is_tool_error(str(f["check"]))]
        lost = [f for f in had if str(f["key"]) not in keys_has] if not any(
            is_tool_error(str(f["check"])) for f in has) else []
        for direction, changed in (("gained", gained), ("lost", lost)):
            if changed:
                out.append({"position": int(row["position"]), "seconds": float(row["seconds"]),
                            "scenario": row["scenario"], "key": str(changed[0]["key"]),
                            "check": str(changed[0]["check"]), "direction": direction})
                break
        if len(out) >= limit:
            break
    return out


MEMORY_TOLERANCE = 0.10
"""``zerostate diff``'s default ``--memory-tolerance``: a head peak above (1 + this) x base's is a regression."""


def peak_grew(base: int, head: int, tolerance: float = MEMORY_TOLERANCE) -> bool:
    """``diff``'s regression rule (`reports.diff_memory.compare`): head's gathered peak beyond (1 + tolerance)
    times base's, or a peak where base had none."""
    return head > 0 if base == 0 else head / base > 1.0 + tolerance


def grown_examples(unfaulted: Sequence[Mapping[str, Any]], faulted: Sequence[Mapping[str, Any]],
                   limit: int, tolerance: float = MEMORY_TOLERANCE) -> list[dict[str, Any]]:
    """The first ``limit`` generated examples, the same scenario at the same position in both runs, measured
    in both (``gathered``: a ZeRO-3 run to its end), whose gathered-parameter peak is `peak_grew` on the
    faulted tree: ``{"position", "seconds", "scenario", "base", "head"}`` (the peaks, in elements)."""
    out: list[dict[str, Any]] = []
    for other, row in same_examples(unfaulted, faulted):
        a, b = other.get("gathered"), row.get("gathered")
        if a and b and peak_grew(int(a["peak_elements"]), int(b["peak_elements"]), tolerance):
            out.append({"position": int(row["position"]), "seconds": float(row["seconds"]),
                        "scenario": row["scenario"], "base": int(a["peak_elements"]),
                        "head": int(b["peak_elements"])})
            if len(out) >= limit:
                break
    return out


def fixed(faulted: Mapping[str, Any], unfaulted: Mapping[str, Any]) -> bool:
    """The fault made this example pass: its replay shows the finding on the unfaulted tree, and on the faulted
    tree the finding's check holds (an outcome the fault changed, in the other direction from `introduced`)."""
    return shows(unfaulted) and faulted.get("passed") is True


def seen_in(report: dict[str, Any], already: dict[str, SeenFinding]) -> dict[str, SeenFinding]:
    """``already`` plus the findings of ``report`` (a report.json) not in it, timed by this report's flush."""
    out = dict(already)
    run = report.get("run", {})
    for entry in report.get("findings", []):
        key = str(entry.get("key"))
        if key in out:
            continue
        out[key] = SeenFinding(key=key, check=str(entry.get("check")), error=str(entry.get("error") or ""),
                               known_issue=label_of(entry), seconds=float(run.get("seconds", 0.0)),
                               examples=run.get("examples_run"), n=len(out) + 1)
    return out


__all__ = ["MEMORY_TOLERANCE", "SeenFinding", "TOOL_CHECKS", "Verdict", "changed_examples", "final_labels", "fixed",
           "grown_examples", "introduced", "is_tool_error", "judge", "label_of", "old_key_candidates", "peak_grew",
           "same_examples", "seen_in", "shows"]
