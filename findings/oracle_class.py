"""What an oracle disagreement no known issue explains did, as its own run shows it: `signature`.

An unlabelled ``oracle`` finding's key carries this signature (`Finding.key`), so two different new
differences from PyTorch in one exploration are two findings, and a new one beside an old one is not hidden
by it.  The signature reads only what shrinking and replay leave the same for one mechanism: how DeepSpeed's
update of the differing parameters relates to PyTorch's when they all share it (none, the sign flipped, twice,
half, a counterfactual part of the gradient; ``other`` for anything else or a mixture), whether PyTorch moved
those parameters at all (frozen or without a gradient), and whether the difference came at the first step that
trained or at a later one.  Never parameter names, sizes, counts or the step's number, which shrinking
changes."""

from __future__ import annotations

from collections.abc import Sequence

from zerostate.model.events import Event, EventKind

from zerostate.findings.evidence import OracleDiff, ParamDiff

_NEAR = 0.05
"""How close (absolute, on the update ratio) counts as exactly none, the same size, or the sign flipped."""
_FACTORS = ((2.0, "x2"), (0.5, "x0.5"))
"""Named factors (relative tolerance `_NEAR`): a doubled or halved update."""
OTHER = "other"
"""Any other relation, and a mixture of classes over the differing parameters: a clipped, partly lost or
otherwise distorted update gives each parameter its own ratio, which shrinking and the drawn shape move
across any finer boundary: one mechanism would give many keys if each parameter's class counted
(docs/deepspeed-target.md has the count)."""


def update_class(p: ParamDiff, moved: Sequence[str]) -> str:
    """How DeepSpeed's update of one differing parameter relates to PyTorch's (`OracleDiff` row)."""
    if p.param in moved:  # PyTorch left it where it was (frozen, or no gradient reached it)
        return "stale-update-again" if p.again is not None and abs(p.again - 1.0) <= 0.1 else "moved-without-update"
    by_ratio = ratio_class(p.ratio)
    if by_ratio == "not-updated":  # with one backward in the step, "without its share" is no update too
        return by_ratio
    if p.last_only and not p.but_last:
        return "last-backward-only"
    if p.but_last and not p.last_only:
        return "without-last-backward"
    return by_ratio


def ratio_class(r: float | None) -> str:
    """A projection of DeepSpeed's update on PyTorch's as a class: none, the other way, a named factor, or
    `OTHER`."""
    if r is None:
        return OTHER  # neither side moved it beyond the tolerance, yet they differ
    if abs(r) <= _NEAR:
        return "not-updated"
    if abs(r + 1.0) <= _NEAR:
        return "sign-flipped"
    for k, name in _FACTORS:
        if abs(r / k - 1.0) <= _NEAR:
            return name
    return OTHER


def _one(classes: set[str], mixed: str) -> str:
    """The class every parameter shares, else ``mixed``."""
    return next(iter(classes)) if len(classes) == 1 else mixed


def trained_before(events: Sequence[Event], step: int) -> bool:
    """A train step before ``step`` had a user backward (it could have updated something)."""
    backward = False
    for e in events:
        if e.kind is EventKind.USER_BACKWARD_START:
            backward = True
        elif e.kind is EventKind.STEP:
            if e.value is None or e.value >= step:
                return False
            if backward:
                return True
            backward = False
    return False


def signature(o: OracleDiff, events: Sequence[Event] | None) -> str:
    """``TRAINABLE[+KEPT]@WHEN``: the class the differing parameters PyTorch updated share (`OTHER` when they do
    not), plus how DeepSpeed moved those PyTorch left where they were (frozen or without a gradient), and
    whether a step before had trained (``x0.5@first-step``, ``not-updated+moved-without-update@later-step``);
    prefixed by the comparison's kind when it is not ``params``; just the kind when it names no parameter and
    no ratio (a generation, the skipped steps of loss scaling)."""
    prefix = "" if o.kind == "params" else f"{o.kind}:"
    trainable = {update_class(p, o.moved) for p in o.params if p.param not in o.moved}
    kept = {update_class(p, o.moved) for p in o.params if p.param in o.moved}
    parts = ([_one(trainable, OTHER)] if trainable else []) + ([_one(kept, "moved-without-update")] if kept else [])
    if not parts and o.ratio is not None:
        parts = [ratio_class(o.ratio)]
    if not parts:
        return o.kind
    classes = "+".join(parts)
    if o.step is None:
        return f"{prefix}{classes}"
    later = trained_before(events, o.step) if events else o.step > 0
    return f"{prefix}{classes}@{'later-step' if later else 'first-step'}"


__all__ = ["OTHER", "ratio_class", "signature", "trained_before", "update_class"]
