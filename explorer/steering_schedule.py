"""The steering scheduler: the next round's draw weights from what the last round reached.  Pure, integers only.

``schedule(W_k, folded) -> W_{k+1}``.  ``folded`` is round k's examples in *sequence position* order, each
reduced to the alternatives it took at each choice point (`choices.taken`) and how many signal units it
reached that nothing before it had (`signal.fold`: new DeepSpeed arcs and new spec-monitor states).  Per
point, each alternative scores its current weight times its mean gain relative to the round's mean gain,
with `PRIOR` pseudo-examples at the round's mean (an alternative no example took keeps its weight; one
whose examples found nothing new sinks, one whose examples found a lot rises).  The point's weights are
then re-cut from a fixed total (the default counts times `choices.SCALE`): every alternative keeps at
least half its default weight (`floor`: a setup that found nothing new is still drawn), the other half is
shared out by score, and no alternative exceeds `CAP` times its default (`cap`).  Integer arithmetic and
index-ordered tie-breaks: the same inputs give the same table on every machine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from collections.abc import Sequence

from zerostate.explorer.choices import POINTS, SCALE, Taken, Weights

CAP = 4
"""An alternative's weight is at most this many times its default (its rate likewise: the total is fixed)."""
PRIOR = 2
"""Pseudo-examples at the round's mean gain in each alternative's mean: two lucky examples move a rate less."""
RESOLUTION = 1 << 16
"""Scores are integers in units of 1/RESOLUTION of a weight."""


@dataclass(frozen=True)
class Folded:
    """One example of a round, as the scheduler sees it."""

    taken: tuple[Taken, ...]
    """Per point (`choices.POINTS` order), the alternatives the example shows it took."""
    new: int
    """Signal units it reached first (in sequence order)."""


def floor(default: int) -> int:
    return default * SCALE // 2


def cap(default: int) -> int:
    return default * SCALE * CAP


def schedule(w: Weights, folded: Sequence[Folded]) -> Weights:
    """The next round's weights (module docstring); ``w`` itself when the round reached nothing new."""
    n, total = len(folded), sum(f.new for f in folded)
    if n == 0 or total == 0:
        return w
    table = []
    for i, point in enumerate(POINTS):
        cur = w.table[i]
        count, gain = [0] * len(cur), [0] * len(cur)
        for f in folded:
            for a in f.taken[i]:
                count[a] += 1
                gain[a] += f.new
        scores = [cur[a] * RESOLUTION * (gain[a] * n + PRIOR * total) // ((count[a] + PRIOR) * total)
                  for a in range(len(cur))]
        table.append(recut(scores, point.default))
    return Weights(tuple(table))


def recut(scores: Sequence[int], default: Sequence[int]) -> tuple[int, ...]:
    """Weights summing to ``sum(default) * SCALE``: each its `floor`, the rest shared in proportion to
    ``scores`` (largest remainders first, lower index on ties), none above its `cap`."""
    alloc = [floor(d) for d in default]
    left = sum(default) * SCALE - sum(alloc)
    active = [a for a in range(len(default)) if alloc[a] < cap(default[a])]
    while left > 0 and active:
        weight = [scores[a] for a in active]
        if not any(weight):  # nothing scores: share by the default rates
            weight = [default[a] for a in active]
        total = sum(weight)
        share = {a: left * s // total for a, s in zip(active, weight, strict=True)}
        over = [a for a in active if alloc[a] + share[a] > cap(default[a])]
        if over:  # those stop at their cap; the rest is shared again among the others
            for a in over:
                left -= cap(default[a]) - alloc[a]
                alloc[a] = cap(default[a])
            active = [a for a in active if a not in over]
            continue
        rem = {a: left * s % total for a, s in zip(active, weight, strict=True)}
        for a in active:
            alloc[a] += share[a]
        left -= sum(share.values())
        for a in sorted(active, key=lambda a: (-rem[a], a)):
            if left == 0:
                break
            if alloc[a] < cap(default[a]):
                alloc[a] += 1
                left -= 1
    return tuple(alloc)


def round_seed(seed: int, k: int) -> int:
    """Round ``k``'s Hypothesis seed: ``seed`` itself for round 0 (so round 0 is the unsteered sequence's start),
    then a digest of (seed, k)."""
    if k == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"zerostate-round:{seed}:{k}".encode()).digest()[:8], "big")


__all__ = ["CAP", "Folded", "PRIOR", "cap", "floor", "recut", "round_seed", "schedule"]
