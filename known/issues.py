"""The one known-issue table: every documented DeepSpeed bug (open or fixed, the seed bugs included) and model
gap, as `KnownIssue` records, in the order `explain` tries them; and `explain`, the one rule that names the
issue a finding shows.

The generated tests keep each issue as a strict expected failure on its exact scenario (so a fix in
DeepSpeed, or in the model, turns the test red until the entry is retired), and the property tests
accept a finding only when a `KnownIssue` explains it -- anything else fails the test.  Repro scripts:
``zerostate replay`` / `repro.repro_script` on the scenario; docs/deepspeed-target.md has the details.
The records live in data modules by area: `zero_hooks` (hook and coordinator lifecycle), `setups`
(training-setup dimensions), `fixed` (older releases' bugs), `seeds` (the seed bugs).
"""

from __future__ import annotations

from zerostate.findings.finding import Finding
from zerostate.known.fixed import FIXED_ISSUES
from zerostate.known.issue import KnownIssue
from zerostate.known.seeds import SEED_000_PART1, SEED_000_PART2, SEED_002, SEED_ISSUES
from zerostate.known.setups import SETUP_ISSUES
from zerostate.known.zero_hooks import (HOOK_ISSUES, LATE_HOOK_ISSUES, Z3_KEPT_FOR_REUSE_THEN_BRANCH,
                                        Z3_LEAF_INPUT_NO_GRAD, Z3_LEAF_KEPT_GATHERED, Z3_NO_POST_BACKWARD_NO_DRAIN,
                                        Z3_PERSISTENT_PARAM_RACE_WS2, Z3_REREGISTER_WHILE_RECORDING,
                                        ZERO12_NO_GRADIENT)

PINNED = "0.19.8"
"""The release the ``explore`` extra pins."""

# The older releases' issues first: their predicates name their option (and, for exceptions, the message),
# so on a release they affect they win over a broader predicate for a finding whose unshrunk scenario has both
KNOWN_ISSUES: tuple[KnownIssue, ...] = FIXED_ISSUES + HOOK_ISSUES + SETUP_ISSUES + LATE_HOOK_ISSUES + SEED_ISSUES

_BY_ID = {k.id: k for k in KNOWN_ISSUES}


def by_id(issue_id: str) -> KnownIssue | None:
    return _BY_ID.get(issue_id)


def explain(f: Finding) -> KnownIssue | None:
    """The known issue that explains a finding on the release it was found on (any release when the finding
    names none), or None; for a sum of known mechanisms, the first of `explain_all`."""
    found = explain_all(f)
    return found[0] if found else None


def explain_all(f: Finding) -> tuple[KnownIssue, ...]:
    """Every known issue the finding's evidence shows, on the release it was found on: one, or for an oracle
    difference that a sum of known mechanisms explains, the issue of each mechanism -- and none when any of its
    mechanisms is no known issue of that release (a sum is known only whole)."""
    def here(k: KnownIssue) -> bool:
        return f.deepspeed is None or k.affects(f.deepspeed)
    if f.check == "oracle" and f.evidence.explained_by:
        mechanisms = f.evidence.explained_by
        issues = [next((k for k in KNOWN_ISSUES if m in k.mechanisms and here(k)), None) for m in mechanisms]
        if not issues or any(k is None for k in issues):
            return ()
        return tuple(dict.fromkeys(k for k in issues if k is not None))
    return next(((k,) for k in KNOWN_ISSUES if k.recognises(f) and here(k)), ())


SEED_BUGS = {"0.18.4": (SEED_000_PART1.id, SEED_000_PART1.explains),
             "0.18.6": (SEED_000_PART2.id, SEED_000_PART2.explains),
             "0.19.2": (SEED_002.id, SEED_002.explains)}
"""Release -> (seed issue id, its rule): the release each seed bug's acceptance explores."""

__all__ = ["KNOWN_ISSUES", "KnownIssue", "PINNED", "SEED_BUGS", "Z3_KEPT_FOR_REUSE_THEN_BRANCH",
           "Z3_LEAF_INPUT_NO_GRAD", "Z3_LEAF_KEPT_GATHERED", "Z3_NO_POST_BACKWARD_NO_DRAIN",
           "Z3_PERSISTENT_PARAM_RACE_WS2", "Z3_REREGISTER_WHILE_RECORDING", "ZERO12_NO_GRADIENT", "by_id", "explain",
           "explain_all"]
