"""`Finding`: one check a run failed, on its scenario, with the evidence the run left.

``Finding.key`` (check id, plus origin for exceptions or the spec's violation code) is what makes two
findings the same bug: the explorer reports one per key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from zerostate.model.events import Event, EventKind
from zerostate.model.scenario import Scenario


_SINGLE_KEY = frozenset({"oracle", "model-agreement", "hang", "crash", "internal", "exception"})


def message_shape(text: str) -> str:
    """A spec message with the specifics blanked: parameter and module names, lists, numbers."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    first = re.sub(r"\[[^\]]*\]", "[...]", first)
    first = re.sub(r"\b(blocks\.\d+(\.\w+)*|head(\.weight)?|model)\b", "X", first)
    first = re.sub(r"(X(, )?)+", "X", first)
    first = re.sub(r"\d+", "N", first)
    first = re.sub(r"\bare\b", "is", re.sub(r"\bhave\b", "has", first))
    return first


@dataclass
class Finding:
    check: str
    error: str
    scenario: Scenario
    trace: list[Event] | None = None
    index: int | None = None
    target: str = ""
    deepspeed: str | None = None
    origin: str | None = None
    """For ``exception`` findings: ``ExcType@module.function`` where DeepSpeed raised."""
    code: str = ""
    """For spec findings: the violation's code inside its spec (``hook-after-epilogue``), from the monitor."""
    confirmation: Any = None
    """explore: its replay in a fresh worker before hand-over (`targets.confirm`); None until then."""
    shrunk: bool = True
    """explore: False while handed over at once, before it is shrunk (its final finding follows)."""
    world_size: int = 1
    """The ranks it ran on (set by the rank pool target, ranks.py; its repro script runs under torchrun)."""
    known: str = ""
    """For ``oracle`` findings: the id of the documented known issue that explains it (`known.tag_oracle`),
    "" when none does.  Part of the key, so a documented oracle bug never hides an unexplained one behind
    the one key ``oracle`` (the explorer keeps one finding per key)."""

    @property
    def key(self) -> str:
        """What makes two findings the same bug: the check id, plus where an exception was raised, or the
        spec's violation code (``epilogue-once:no-epilogue`` and ``epilogue-once:hook-after-epilogue`` are
        two findings), plus the phase.  Never the message: rewording a message changes no finding's
        identity (every spec monitor and the cross-rank checks give a code; a check without one is one key)."""
        if self.origin:
            return f"{self.check}:{self.origin}"
        if self.known:
            return f"{self.check}:{self.known}"
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
        return {"check": self.check, "key": self.key, "error": self.error, "blocks": len(self.scenario.blocks),
                "steps": len(self.scenario.steps), "scenario": self.scenario.to_dict()}

    @property
    def size(self) -> tuple[int, int, int]:
        """A total order on how small the scenario is (blocks, micro-steps, JSON length)."""
        return (len(self.scenario.blocks), self.scenario.num_micro_steps, len(self.scenario.to_json(None)))


__all__ = ["Finding", "message_shape"]
