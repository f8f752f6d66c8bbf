"""The watch's violations and crashes as `Finding` s, decided by `zerostate.findings.decide` and labelled by
`zerostate.known.labels` -- the same table and rules ``zerostate explore`` labels its findings with.

* A spec violation: the online checker's fold (`zerostate.model.fold`, the fold ``decide``'s spec judgement runs)
  failed a monitor at an event; its failure is the `Decision` ``decide`` makes of a spec violation (check, message,
  code, index), turned into a `Finding` by `findings.build.findings_of` with the rank's evidence trace (the events
  of the train step before and of this one, `OnlineChecker.evidence`).
* An exception (one escaping an engine call, or the one that ended a process): `findings.decide.decide_trace` with
  its ``"ExcType: message"`` and origin, the finding's evidence the exception with its frames
  (`findings.evidence.Raised`), so a rule sees which DeepSpeed function raised it.
* An exception raised in the job's own code -- its innermost frames are the job's, with no DeepSpeed frame between
  the job's frame and the raise (`raised_by_the_job`) -- is the job's crash: reported as such, never labelled.

Each finding is then labelled (`known.labels.labelled`); a report shows `known.labels.label` (the dict explore's
reports show) and the issue record's ``runtime_prevents`` (`explanation`).  Imported by a watched process when it
first has something to judge (never by the ``sitecustomize``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zerostate.findings.build import findings_of
from zerostate.findings.decide import Decision, decide_trace
from zerostate.findings.evidence import raised_of
from zerostate.findings.finding import Finding
from zerostate.findings.harness import harness_error
from zerostate.findings.origin import origin_of
from zerostate.findings.record import ExceptionRecord, Frame
from zerostate.known.issues import by_id
from zerostate.known.labels import label, labelled
from zerostate.model.events import Event

TARGET = "deepspeed (your job)"
"""The target a watch finding names (a user's job: no scenario, no oracle)."""


def frame_of(d: Mapping[str, Any] | Frame) -> Frame:
    """A `Frame` from its dict (a watched process writes its frames as dicts: `zerostate.watcher.process.frames`)."""
    if isinstance(d, Frame):
        return d
    return Frame(str(d.get("package", "other")), str(d.get("file", "")), str(d.get("function", "")),
                 int(d.get("line", 0) or 0), str(d.get("module", "")))


def frames_of(ds: Iterable[Mapping[str, Any] | Frame]) -> tuple[Frame, ...]:
    return tuple(frame_of(d) for d in ds)


def raised_by_the_job(frames: Sequence[Mapping[str, Any] | Frame]) -> bool:
    """The exception was raised in the job's own code: walking out from the raise, a frame of the job's code
    (``other``: no module of deepspeed, torch, transformers, peft or zerostate) comes before any DeepSpeed frame.
    False without frames, and for an exception raised in DeepSpeed or under it (torch called from DeepSpeed)."""
    for f in reversed(frames_of(frames)):
        if f.package == "deepspeed":
            return False
        if f.package == "other":
            return True
    return False


def where_in_the_job(frames: Sequence[Mapping[str, Any] | Frame]) -> str:
    """``file:line in function`` of the innermost frame of the job's own code ("" when none)."""
    for f in reversed(frames_of(frames)):
        if f.package == "other":
            return f"{f.file}:{f.line} in {f.function}"
    return ""


def violation(spec: str, message: str, code: str, trace: Sequence[Event], index: int | None, version: str | None,
              world_size: int = 1) -> Finding:
    """The labelled `Finding` of a spec violation the online checker found at ``trace[index]`` (None: an
    obligation still open at the end)."""
    decision = Decision(spec, message, code=code, index=index)
    (f,) = findings_of([decision], None, trace, TARGET, version, world_size)
    return labelled(f)


def exception(text: str, frames: Sequence[Mapping[str, Any] | Frame], trace: Sequence[Event], stage: int,
              version: str | None, world_size: int = 1) -> Finding:
    """The `Finding` of an exception (``text``: ``"ExcType: message"``) raised with ``frames`` (outermost first),
    after the events of ``trace``: decided by `decide_trace`, labelled unless the job's own code raised it
    (`raised_by_the_job`: then its ``known`` stays "")."""
    fs = frames_of(frames)
    record = ExceptionRecord(text, "", fs)
    decisions = [d for d in decide_trace(trace, stage, error=text, origin=origin_of(record), specs=())
                 if d.check in ("exception", "saved-tensor-intact")]
    (f,) = findings_of(decisions[:1], None, trace, TARGET, version, world_size)
    f = dataclasses.replace(f, evidence=dataclasses.replace(f.evidence, raised=raised_of(record)))
    return f if raised_by_the_job(fs) else labelled(f)


def explanation(f: Finding) -> dict[str, Any] | None:
    """What a watch report says of the known issue explaining ``f``: `known.labels.label` (explore's dict) plus the
    record's ``runtime_prevents`` (``zerostate watch --runtime`` prevents it) and ``detail``; None when none does."""
    lab = label(f) if f.known else None
    issue = by_id(f.known) if f.known else None
    if lab is None or issue is None:
        return None
    return dict(lab, runtime_prevents=issue.runtime_prevents, detail=issue.detail)


def judged(f: Finding) -> dict[str, Any]:
    """The fields a watch record keeps of a finding: its key, root-cause group, origin, the known issue
    (``known_issue``: `known.labels.label`; ``explanation``: with the runtime hint), and ``harness_error`` when it is
    zerostate's own failure (`findings.harness.harness_error`), never DeepSpeed's."""
    return {"key": f.key, "group": f.group, "origin": f.origin, "known_issue": label(f) if f.known else None,
            "explanation": explanation(f), "harness_error": harness_error(f)}


__all__ = ["TARGET", "exception", "explanation", "frame_of", "frames_of", "judged", "raised_by_the_job",
           "violation", "where_in_the_job"]
