"""`Finding`: one check a run failed, on its scenario, with the evidence the run left.

A finding is a value: frozen once built.  What later steps add -- the known issue and root-cause group
(`known.labels.labelled`), the explorer's ``shrunk`` and ``confirmation`` -- comes as a new value from
`dataclasses.replace`.  ``Finding.key`` is its fingerprint (`findings.fingerprint`), what makes two findings
the same bug: the explorer reports one per key, shrinking keeps it, ``diff`` matches by it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol

from zerostate.model.events import Event
from zerostate.model.scenario import Scenario

from zerostate.findings.evidence import NO_EVIDENCE, Evidence
from zerostate.findings.fingerprint import fingerprint, params_in


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
    """The id of the known issue that explains it (`known.labels.labelled`), "" when none does; never part of
    its key."""
    also_known: tuple[str, ...] = ()
    """For an oracle difference that a sum of known mechanisms explains: the ids of the known issues besides
    ``known`` (`known.labels.labelled`)."""
    group: str = ""
    """Its root-cause group (`known.labels.labelled`): the known issue's id, else the shape of what went wrong."""
    evidence: Evidence = NO_EVIDENCE
    """What its own run shows besides the trace: the exception (type, message, frames), the oracle's
    disagreement (parameters, sizes, direction)."""

    @property
    def key(self) -> str:
        """What makes two findings the same bug: its fingerprint, built only from what its run showed
        (`fingerprint.fingerprint`: an exception's type, innermost DeepSpeed frame and abstracted message; a
        spec's code, the violating event's pattern and the roles of the parameters involved; an oracle
        difference's counterfactual class).  Never the message's specifics, never the known issue's label."""
        return fingerprint(self.check, self.code, self.evidence, self.trace, self.index, params_in(self.error),
                           self.origin or "")

    @property
    def violation(self) -> str:
        """``check:code`` (``released-after-backward:still-gathered``): which failure of its check it is, what a
        known issue's evidence rule reads beside the events (never its identity: that is `key`)."""
        return f"{self.check}:{self.code}" if self.code else self.check

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
