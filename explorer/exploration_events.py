"""What an exploration yields: one typed event per thing that happened, in the order it happened.

A consumer (``zerostate explore``, ``zerostate diff``, `exploration.explore`) iterates `Exploration.events`
and never keeps findings of its own: each finding event carries the finding's number, the finding and
its stage, and a later event for the same number replaces the earlier one.

* `Seen`       -- generate (or shrink) met a new key: its first example, handed over at once, unshrunk;
* `Shrunk`     -- the key's last scenario (shrunk, or left as seen by the budget or a stop), confirmation
  pending (``finding.confirmation`` None);
* `Confirmed`  -- the same finding with its confirmation (`confirm.Confirmation`): final;
* `Progress`   -- after every distinct target run;
* `Restarted`  -- a worker was restarted (a hang, a crash, ranks out of step) after a distinct run;
* `Renumbered` -- a complete run's findings in their final order (the order the generated sequence first
  met them), numbered 1..n, when that differs from the hand-over order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from zerostate.findings.finding import Finding


class Stage(enum.Enum):
    """How far a finding's scenario got."""

    UNSHRUNK = "unshrunk"
    """Handed over at once: the first example with its key."""
    SHRUNK = "shrunk"
    AS_SEEN = "as seen"
    """The hard cap or a stop came first: the smallest scenario it was seen in."""


@dataclass(frozen=True)
class FindingEvent:
    """A finding as handed over under number ``n`` (the hand-over order, 1..n)."""

    n: int
    finding: Finding
    stage: Stage

    @property
    def key(self) -> str:
        return self.finding.key

    @property
    def past_hand_over(self) -> bool:
        """Shrunk or left as seen: its confirmation is (or will be) part of what a report shows."""
        return self.stage is not Stage.UNSHRUNK


@dataclass(frozen=True)
class Seen(FindingEvent):
    """A new key, handed over unshrunk; shrinking and confirmation follow (or a stop leaves it so)."""


@dataclass(frozen=True)
class Shrunk(FindingEvent):
    """The key's last scenario (``stage`` SHRUNK or AS_SEEN); its confirmation follows."""


@dataclass(frozen=True)
class Confirmed(FindingEvent):
    """The key's final finding, with its confirmation (``not-checked`` when confirmation is off)."""


@dataclass(frozen=True)
class Progress:
    examples_run: int
    """Distinct target runs so far, shrinking included."""
    findings: int
    """Keys handed over so far."""
    seconds: float


@dataclass(frozen=True)
class Restarted:
    example: int
    """The distinct run after which the worker was restarted."""
    why: str

    def to_dict(self) -> dict[str, int | str]:
        return {"example": self.example, "why": self.why}


@dataclass(frozen=True)
class Renumbered:
    """Every finding of a complete run in its final order; ``findings[i].n == i + 1``."""

    findings: tuple[FindingEvent, ...]


Event = Seen | Shrunk | Confirmed | Progress | Restarted | Renumbered

__all__ = ["Confirmed", "Event", "FindingEvent", "Progress", "Renumbered", "Restarted", "Seen", "Shrunk", "Stage"]
