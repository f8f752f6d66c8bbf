"""Judging a `Setup` against the known-issue table: which issues of a release its setup is in the family of.

An issue's family is the setups that have everything one of its repros has (`dimensions.requirements` of its
scenario and each variant).  A repro *matches* when no requirement is known to be unmet; the requirements nobody
said are its conditions ("if your loop retains the graph").  So a match says "may be hit", never "is hit": the
repro's other details (its sizes, its exact schedule) are not the user's, and only a run shows the bug
(``--replay`` runs the repro; ``zerostate watch`` watches the job)."""

from __future__ import annotations

from dataclasses import dataclass

from zerostate.doctor.dimensions import BY_NAME, Kind, Value, requirements
from zerostate.doctor.setup import Fact, Setup
from zerostate.known.issue import KnownIssue, Nature
from zerostate.known.issues import KNOWN_ISSUES, PINNED
from zerostate.model.scenario import Scenario
from zerostate.tracing import compat


@dataclass(frozen=True)
class Need:
    """One requirement of a repro and what the setup says of it."""

    dimension: str
    value: Value
    fact: Fact

    @property
    def met(self) -> bool | None:
        """True / False when the setup says, None when it does not."""
        if self.fact.value is None:
            return None
        return BY_NAME[self.dimension].holds(self.value, self.fact.value)

    def says(self) -> str:
        return BY_NAME[self.dimension].says(self.value)


@dataclass(frozen=True)
class Match:
    """One repro of an issue against the setup."""

    repro: Scenario
    which: str
    """``its repro`` or ``variant N``."""
    needs: tuple[Need, ...]

    @property
    def met(self) -> tuple[Need, ...]:
        return tuple(n for n in self.needs if n.met is True)

    @property
    def unsaid(self) -> tuple[Need, ...]:
        return tuple(n for n in self.needs if n.met is None)

    @property
    def missed(self) -> tuple[Need, ...]:
        return tuple(n for n in self.needs if n.met is False)

    @property
    def in_family(self) -> bool:
        return not self.missed


@dataclass(frozen=True)
class Entry:
    """An issue whose family the setup is in, on the release judged."""

    issue: KnownIssue
    match: Match
    """The nearest repro: one in the family with the fewest unsaid conditions."""
    avoid: tuple[str, ...]
    """What is known to avoid it: the release that fixes it, the runtime that prevents it."""
    leaves_family: tuple[str, ...]
    """Setup changes after which none of its repros matches: no repro without them, not a tested workaround."""
    established: bool
    """The release is one the issue's range was established on; False for a release newer than the table, where an
    open issue is neither known present nor known fixed."""


@dataclass(frozen=True)
class Diagnosis:
    setup: Setup
    release: str
    entries: tuple[Entry, ...]
    checked: int
    """The known DeepSpeed issues judged against this release."""
    elsewhere: tuple[str, ...]
    """Issues whose family the setup is in on other releases only (fixed before this one, or not yet in it)."""
    newer_than_table: bool


def matches(issue: KnownIssue, setup: Setup) -> list[Match]:
    """Every repro of ``issue`` against ``setup``, the scenario first."""
    out = []
    for i, sc in enumerate((issue.scenario, *issue.variants)):
        need = requirements(sc, issue.world_size)
        out.append(Match(sc, "its repro" if i == 0 else f"variant {i}",
                         tuple(Need(d, v, setup.fact(d)) for d, v in need.items())))
    return out


def nearest(issue: KnownIssue, setup: Setup) -> Match | None:
    """The repro in the family with the fewest unsaid conditions (config and model ones weigh more than the loop's),
    or None when the setup is in no repro's family."""
    inside = [m for m in matches(issue, setup) if m.in_family]
    if not inside:
        return None
    return min(inside, key=lambda m: (sum(BY_NAME[n.dimension].kind is not Kind.LOOP for n in m.unsaid),
                                      len(m.unsaid)))


CHANGES: tuple[tuple[str, dict[str, Value]], ...] = (
    ("reentrant checkpointing instead (use_reentrant=True)",
     {"reentrant_checkpointing": True, "non_reentrant_checkpointing": False}),
    ("non-reentrant checkpointing instead (use_reentrant=False)",
     {"reentrant_checkpointing": False, "non_reentrant_checkpointing": True}),
    ("no activation checkpointing", {"reentrant_checkpointing": False, "non_reentrant_checkpointing": False,
                                     "frozen_in_checkpointed": False}),
    ("no optimizer offload", {"offload_optimizer": False}),
    ("no parameter offload", {"offload_param": False}),
    ("gradient_clipping 0", {"clipping": False}),
    ("bf16 gradients accumulated in bf16 (no data_types.grad_accum_dtype fp32)", {"fp32_grad_accum": False}),
    ("stage3_param_persistence_threshold 0", {"persistent_params": False}),
    ("stage3_prefetch_bucket_size 0", {"prefetch": False}),
    ("contiguous_gradients true", {"no_contiguous_gradients": False}),
    ("reduce_scatter true", {"no_reduce_scatter": False}),
    ("overlap_comm left at DeepSpeed's default", {"overlap_comm_changed": False}),
    ("stage3_use_all_reduce_for_fetch_params false", {"all_reduce_fetch": False}),
    ("the model built outside deepspeed.zero.Init", {"zero_init": False}),
    ("no modules_to_save", {"modules_to_save": False}),
    ("ZeRO stage 1", {"stage": 1}),
    ("ZeRO stage 2", {"stage": 2}),
    ("ZeRO stage 3", {"stage": 3}),
)
"""Setup changes a user can make in a config or the model's wrapping, tried one at a time for `avoid`."""


def _changes_out(issue: KnownIssue, setup: Setup) -> list[str]:
    """The changes that take the setup out of every repro's family of ``issue`` (each from what the setup has now)."""
    out = []
    for what, change in CHANGES:
        if all(setup.fact(d).value == v for d, v in change.items()):
            continue  # the setup already is so
        changed = setup.with_facts({d: Fact(v, what) for d, v in change.items()})
        if nearest(issue, changed) is None:
            out.append(what)
    return out


def avoid(issue: KnownIssue) -> tuple[str, ...]:
    """What is known to avoid ``issue``: the release that fixes it, zerostate's runtime where it prevents it."""
    out = []
    if issue.fixed_in:
        out.append(f"DeepSpeed {issue.fixed_in} or later")
    if issue.runtime_prevents:
        out.append("zerostate.runtime.patch_deepspeed() before deepspeed.initialize (docs/runtime.md)")
    return tuple(out)


def _newer_than_table(release: str) -> bool:
    return bool(compat.version_tuple(release) > compat.version_tuple(PINNED))


def deepspeed_issues() -> tuple[KnownIssue, ...]:
    """The issues of DeepSpeed's own (bugs and documented limitations), not the model's gaps."""
    return tuple(k for k in KNOWN_ISSUES if k.owner == "deepspeed")


def diagnose(setup: Setup, release: str) -> Diagnosis:
    """Every known DeepSpeed issue of ``release`` whose family ``setup`` is in; on a release newer than the table's
    newest (`PINNED`), the issues no release is known to fix, marked as not established there."""
    newer = _newer_than_table(release)
    entries, elsewhere, checked = [], [], 0
    for issue in deepspeed_issues():
        here = issue.affects(release) or (newer and issue.fixed_in is None)
        checked += here
        m = nearest(issue, setup)
        if m is None:
            continue
        if not here:
            elsewhere.append(issue.id)
            continue
        entries.append(Entry(issue, m, avoid(issue), tuple(_changes_out(issue, setup)),
                             established=issue.affects(release)))
    entries.sort(key=lambda e: (len(e.match.unsaid), e.issue.nature is Nature.LIMITATION))
    return Diagnosis(setup, release, tuple(entries), checked, tuple(elsewhere), newer)


__all__ = ["CHANGES", "Diagnosis", "Entry", "Match", "Need", "avoid", "deepspeed_issues", "diagnose", "matches",
           "nearest"]
