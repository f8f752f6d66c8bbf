"""`Finding`: one check a run failed, on its scenario, with the evidence the run left.

A finding is a value: frozen once built.  What later steps add -- the known issue and root-cause group
(`known.labels.labelled`), the explorer's ``shrunk`` and ``confirmation`` -- comes as a new value from
`dataclasses.replace`.  ``Finding.key`` (check id, plus origin for exceptions or the spec's violation code)
is what makes two findings the same bug: the explorer reports one per key.  An unlabelled oracle
difference is keyed by its own evidence (`findings.oracle_class`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol

from zerostate.model.events import Event, EventKind
from zerostate.model.scenario import Scenario

from zerostate.findings.evidence import NO_EVIDENCE, Evidence
from zerostate.findings.oracle_class import signature


_SINGLE_KEY = frozenset({"oracle", "model-agreement", "hang", "crash", "internal", "exception"})
_KNOWN_IN_KEY = frozenset({"oracle", "checkpoint"})
"""Checks whose key carries the known issue explaining them: one key (``oracle``; ``checkpoint``'s one code
``zero-to-fp32`` covers two issues) would otherwise let a documented bug hide an unexplained one."""


class Confirmed(Protocol):
    """What a finding's replay in a fresh worker found (`explorer.confirm.Confirmation`)."""

    # read-only members, so the record's own narrower types (list, int) satisfy them
    @property
    def status(self) -> str: ...
    @property
    def repeat(self) -> int | None: ...
    @property
    def sequence(self) -> Sequence[Scenario]: ...
    @property
    def seconds(self) -> float: ...

    def to_dict(self) -> dict[str, Any]: ...


def message_shape(text: str) -> str:
    """A spec message with the specifics blanked: parameter and module names, lists, numbers."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    first = re.sub(r"\[[^\]]*\]", "[...]", first)
    first = re.sub(r"\b(blocks\.\d+(\.\w+)*|head(\.weight)?|model)\b", "X", first)
    first = re.sub(r"(X(, )?)+", "X", first)
    first = re.sub(r"\d+", "N", first)
    first = re.sub(r"\bare\b", "is", re.sub(r"\bhave\b", "has", first))
    return first


@dataclass(frozen=True)
class Finding:
    check: str
    error: str
    scenario: Scenario | None
    """The scenario that ran; None for a finding on a user's job (``zerostate watch``), which has none."""
    trace: Sequence[Event] | None = None
    index: int | None = None
    target: str = ""
    deepspeed: str | None = None
    origin: str | None = None
    """For ``exception`` findings: ``ExcType@module.function`` where DeepSpeed raised."""
    code: str = ""
    """For spec findings: the violation's code inside its spec (``hook-after-epilogue``), from the monitor."""
    confirmation: Confirmed | None = None
    """explore: its replay in a fresh worker before hand-over (`explorer.confirm`); None until then."""
    shrunk: bool = True
    """explore: False while handed over at once, before it is shrunk (its final finding follows)."""
    world_size: int = 1
    """The ranks it ran on (its repro script runs under torchrun when more than one)."""
    known: str = ""
    """The id of the known issue that explains it (`known.labels.labelled`), "" when none does.  Part of the
    key of ``oracle`` and ``checkpoint`` findings (`_KNOWN_IN_KEY`)."""
    group: str = ""
    """Its root-cause group (`known.labels.labelled`): the known issue's id, else the shape of what went wrong."""
    evidence: Evidence = NO_EVIDENCE
    """What its own run shows besides the trace: the exception (type, message, frames), the oracle's
    disagreement (parameters, sizes, direction)."""

    @property
    def key(self) -> str:
        """What makes two findings the same bug: the check id, plus where an exception was raised, or the
        spec's violation code (``epilogue-once:no-epilogue`` and ``epilogue-once:hook-after-epilogue`` are
        two findings), plus the phase.  Never the message: rewording a message changes no finding's
        identity (every spec monitor and the cross-rank checks give a code; a check without one is one key).
        An ``oracle`` difference carries the known issue explaining it, else what its own run shows of it
        (`oracle_class.signature`: ``oracle:x0.5@first-step``); ``oracle`` alone when the run left no evidence."""
        if self.origin:
            return f"{self.check}:{self.origin}"
        if self.known and self.check in _KNOWN_IN_KEY:
            return f"{self.check}:{self.known}"
        if self.check == "oracle" and self.evidence.oracle is not None:
            return f"oracle:{signature(self.evidence.oracle, self.trace)}"
        if self.check in _SINGLE_KEY or not self.code:
            return self.check
        return f"{self.check}:{self.code}{self._phase()}"

    def _phase(self) -> str:
        """`` (in a nested task)`` when the violating event happened in a reentrant checkpoint's nested
        graph task (a later backward phase): the same message from the outer task is another mechanism."""
        if not self.trace or self.index is None or not 0 <= self.index < len(self.trace):
            return ""
        task = self.trace[self.index].task
        if task is None:
            return ""
        for e in self.trace:
            if e.kind is EventKind.TASK_START and e.task == task:
                return " (in a nested task)" if e.note == "nested" else ""
        return ""

    def to_json_dict(self) -> dict[str, Any]:
        sc = self.scenario
        return {"check": self.check, "key": self.key, "error": self.error,
                "blocks": len(sc.blocks) if sc else None, "steps": len(sc.steps) if sc else None,
                "scenario": sc.to_dict() if sc else None}

    @property
    def size(self) -> tuple[int, int, int]:
        """A total order on how small the scenario is (blocks, micro-steps, JSON length): the compact JSON's length
        measures the settings away from their defaults (a scenario is its own key; this is a size, not an identity)."""
        sc = self.scenario
        if sc is None:
            return (0, 0, 0)
        return (len(sc.blocks), sc.num_micro_steps, len(sc.to_json(None)))


__all__ = ["Confirmed", "Finding", "message_shape"]
