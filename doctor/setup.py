"""`Setup`: what the doctor knows of a user's training setup, one `Fact` per dimension, each with where it was read
(a file and key, a DeepSpeed default, a trainer's loop) -- or that nothing said it."""

from __future__ import annotations

from dataclasses import dataclass, field

from zerostate.doctor.dimensions import BY_NAME, Value


class DoctorError(ValueError):
    """Bad input to the doctor: the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class Fact:
    value: Value | None
    """None: not known (no input said it)."""
    source: str
    """Where it was read: ``ds_config.json: zero_optimization.stage``, ``DeepSpeed's default``, ``--peft lora``."""

    @property
    def known(self) -> bool:
        return self.value is not None


UNSAID = Fact(None, "not said by any input")


@dataclass(frozen=True)
class Setup:
    """The facts by dimension name, the release they are judged against, and what the readers assumed."""

    facts: dict[str, Fact] = field(default_factory=dict)
    release: str | None = None
    notes: tuple[str, ...] = ()
    """What a reader could not decide and said so (``auto`` values, TRL's checkpointing override)."""

    def fact(self, name: str) -> Fact:
        if name not in BY_NAME:
            raise KeyError(f"no setup dimension {name!r}")
        return self.facts.get(name, UNSAID)

    def with_facts(self, facts: dict[str, Fact], notes: tuple[str, ...] = ()) -> Setup:
        """This setup with ``facts`` said over it (a later input, or an explicit option, wins)."""
        for name in facts:
            if name not in BY_NAME:
                raise KeyError(f"no setup dimension {name!r}")
        return Setup({**self.facts, **facts}, self.release, self.notes + notes)


__all__ = ["UNSAID", "DoctorError", "Fact", "Setup"]
