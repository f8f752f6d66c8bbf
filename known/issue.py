"""`KnownIssue`: the one record of a documented DeepSpeed bug (open or fixed, a seed bug included) or a gap
in zerostate's model, with the scenario that shows it and the rule that recognises its findings."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from collections.abc import Callable

from zerostate.model.scenario import Scenario

from zerostate.findings.finding import Finding
from zerostate.tracing import compat


Release = tuple[int, int, int]


class Nature(str, Enum):
    """What a known issue is: a bug, or a limitation DeepSpeed documents (in its own tests or log lines)."""

    BUG = "bug"
    LIMITATION = "limitation"


@dataclass(frozen=True)
class KnownIssue:
    id: str
    title: str
    owner: str
    """``deepspeed`` (a DeepSpeed bug) or ``model`` (zerostate's model disagrees with DeepSpeed)."""
    releases: tuple[Release, Release]
    """Half-open range of releases observed to have it (on which releases: docs/known-issues-provenance.md)."""
    scenario: Scenario
    checks: tuple[str, ...]
    explains: Callable[[Finding], bool] | None
    """What its mechanism leaves in a finding's own evidence besides an oracle difference (the exception, the
    violating events, the parameters involved: `known.rules`); None when it shows only as an oracle difference."""
    detail: str
    fixed_in: str | None = None
    """The first DeepSpeed release without it; None while no release fixes it."""
    upstream_patch: str | None = None
    """A proposed fix checked by ``zerostate diff`` (docs/upstream/), when there is one."""
    world_size: int = 1
    """The smallest world size it shows at; at a smaller one its scenario must give no finding."""
    runtime_prevents: bool = False
    """``zerostate.runtime`` prevents it (docs/runtime.md); ``zerostate watch`` says so."""
    scenario_shows_from: Release | None = None
    """The first release on which ``scenario`` shows this issue's own finding, when later than ``releases``
    starts: before it another issue's finding comes first in the scenario (one finding per key)."""
    nature: Nature = Nature.BUG
    cites: str = ""
    """For a limitation: where DeepSpeed documents it (its test, its log line)."""
    mechanisms: tuple[str, ...] = ()
    """For a bug that shows as an oracle difference: its computation on the PyTorch reference
    (`harness.net.counterfactual.MECHANISMS`); an oracle finding is its own exactly when DeepSpeed matches that
    counterfactual reference (`findings.oracle_judgement.explaining`)."""
    variants: tuple[Scenario, ...] = ()
    """More repros of the same mechanism in other forms (another backward kind, another stage): the fingerprints
    their findings give are recorded with the scenario's (`known.recorded`)."""

    def __post_init__(self) -> None:
        if self.nature is Nature.LIMITATION and not self.cites:
            raise ValueError(f"known issue {self.id}: a limitation cites DeepSpeed's own test or log line")

    @property
    def fingerprints(self) -> frozenset[str]:
        """The fingerprints recorded from its own repros (`known.recorded`): an exception or spec finding is its own
        only with one of these."""
        from zerostate.known.recorded import recorded
        return recorded(self.id)

    def recognises(self, f: Finding) -> bool:
        """``f`` shows this issue's mechanism: an oracle difference that one of its `mechanisms`' counterfactual
        references explains; any other finding (an oracle difference of an issue stated by what the ranks
        gathered) whose fingerprint its repros recorded and whose evidence shows the mechanism (`explains`)."""
        if f.check == "oracle" and self.mechanisms:
            return bool(set(self.mechanisms) & set(f.evidence.explained_by or ()))
        return self.explains is not None and f.key in self.fingerprints and self.explains(f)

    def shows_on(self, version: str | None) -> bool:
        """Its scenario shows its own finding on ``version``."""
        return self.affects(version) and (self.scenario_shows_from is None
                                          or compat.version_tuple(str(version)) >= self.scenario_shows_from)

    def affects(self, version: str | None) -> bool:
        if not version:
            return False
        v = compat.version_tuple(version)
        return self.releases[0] <= v < self.releases[1]


__all__ = ["KnownIssue", "Nature", "Release"]
