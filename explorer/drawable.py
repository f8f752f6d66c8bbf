"""Which setup pairs the strategy cannot draw, decided from its own structure instead of sampled.

`choices.PAIRED` read a scenario back; a point a scenario cannot show reads empty (offload at ZeRO stage 0, a z3 leaf
module on the llama family).  `SHOWS_ONLY` states, once, where each point's alternative can show: ``(point,
alternative)`` -> the alternatives (by index) every other point named can show beside it -- an empty set: that point
shows nothing there.  A pair is `undrawable` when one of its two alternatives rules the other out; the pairwise
completion then skips it without the `pairs.DRAWS` draws that used to prove it (it still draws every other pair,
and one that none of its draws takes is still reported as not drawable, so a missing rule costs only time).

Each rule is what `strategies` does: ``test_pairs`` checks the table against draws (no scenario ever takes a pair the
table rules out) and against the default sequence's completion (every pair its draws cannot take is ruled out here).
``None`` as the alternative: every alternative of the point."""

from __future__ import annotations

from functools import cache

from zerostate.explorer.choices import PAIRED as POINTS

# alternatives, by index, as `choices.POINTS` / `pairs.DERIVED` order them
_Z3, _Z1, _Z2 = 0, 1, 2                      # stage: 3, 1, 2
_FP32, _BF16, _FP16 = 0, 1, 2                # precision
_ZERO, _BF16_OPT, _FP16_OPT, _NONE = 0, 1, 2, 3   # wrapper (derived)
_NOT_Z3, _PER_TENSOR, _CONTIGUOUS = 0, 1, 2  # z3_reduce (derived)
_SEVERAL = 2                                 # world: 1, 2 (across-ranks option), several
NOTHING: frozenset[int] = frozenset()
ZERO3 = {"stage": frozenset({_Z3}), "extra:stage0": NOTHING, "wrapper": frozenset({_ZERO}),
         "z3_reduce": frozenset({_PER_TENSOR, _CONTIGUOUS})}
"""What a ZeRO-3-only point's alternatives show beside."""
ZERO_OPTIMIZER = {"extra:stage0": frozenset({0}), "wrapper": frozenset({_ZERO, _BF16_OPT})}
"""What a point shows beside that does not apply at ZeRO stage 0 (offload, overlap_comm, reduce_scatter)."""

SHOWS_ONLY: dict[tuple[str, int | None], dict[str, frozenset[int]]] = {
    # ZeRO stage 0 is the stage0 option drawn at ZeRO-1/2: the stage point then shows nothing
    ("stage", _Z3): {"extra:stage0": NOTHING, "wrapper": frozenset({_ZERO}),
                     "z3_reduce": frozenset({_PER_TENSOR, _CONTIGUOUS})},
    ("stage", _Z1): {"extra:stage0": frozenset({0}), "wrapper": frozenset({_ZERO, _BF16_OPT}),
                     "z3_reduce": frozenset({_NOT_Z3})},
    ("stage", _Z2): {"extra:stage0": frozenset({0}), "wrapper": frozenset({_ZERO}), "z3_reduce": frozenset({_NOT_Z3})},
    ("extra:stage0", 0): {"stage": frozenset({_Z1, _Z2}), "wrapper": frozenset({_ZERO, _BF16_OPT}),
                          "z3_reduce": frozenset({_NOT_Z3})},
    ("extra:stage0", 1): {"stage": NOTHING, "offload": NOTHING, "fp32_grad_accum": NOTHING, "leaf": NOTHING,
                          "extra:overlap_comm": NOTHING, "extra:all_reduce_fetch": NOTHING,
                          "extra:reduce_scatter": NOTHING, "world": frozenset({_SEVERAL}),
                          "wrapper": frozenset({_FP16_OPT, _NONE}), "z3_reduce": frozenset({_NOT_Z3})},
    # ZeRO-3 only; a leaf module is a blocks-family block
    ("leaf", None): {**ZERO3, "llama": frozenset({0})},
    ("extra:all_reduce_fetch", None): ZERO3,
    # all-reduce fetch is ZeRO-3's one across-ranks option: without it a ZeRO-3 draw's world is "several" or 1
    # without an across-ranks option (which reads as no world alternative)
    ("extra:all_reduce_fetch", 0): {**ZERO3, "world": frozenset({_SEVERAL})},
    ("offload", 0): ZERO_OPTIMIZER,
    ("offload", 1): {"extra:stage0": frozenset({0}), "wrapper": frozenset({_ZERO})},
    ("offload", 2): {**ZERO3, "extra:stage0": NOTHING},
    ("offload", 3): {**ZERO3, "extra:stage0": NOTHING},
    ("extra:overlap_comm", None): ZERO_OPTIMIZER,
    ("extra:reduce_scatter", None): ZERO_OPTIMIZER,
    # reduce_scatter "on" is the option turning it off: ZeRO-3 then reduces its contiguous buffer unless
    # contiguous_gradients is off, which the strategy draws below ZeRO-3 only
    ("extra:reduce_scatter", 0): {**ZERO_OPTIMIZER, "z3_reduce": frozenset({_NOT_Z3, _PER_TENSOR})},
    ("extra:reduce_scatter", 1): {**ZERO_OPTIMIZER, "z3_reduce": frozenset({_NOT_Z3, _CONTIGUOUS})},
    ("extra:contiguous_gradients", 1): {"z3_reduce": frozenset({_NOT_Z3, _PER_TENSOR})},
    # fp32 gradient accumulation is a bf16 draw below stage 0; only ZeRO-1's BF16_Optimizer takes it on
    ("fp32_grad_accum", 0): {"precision": frozenset({_BF16}), "extra:stage0": frozenset({0}),
                             "wrapper": frozenset({_ZERO})},
    ("fp32_grad_accum", 1): {"precision": frozenset({_BF16}), "extra:stage0": frozenset({0}),
                             "wrapper": frozenset({_ZERO, _BF16_OPT})},
    ("precision", _FP32): {"fp32_grad_accum": NOTHING, "wrapper": frozenset({_ZERO, _NONE})},
    ("precision", _BF16): {"wrapper": frozenset({_ZERO, _BF16_OPT, _FP16_OPT})},
    ("precision", _FP16): {"fp32_grad_accum": NOTHING, "wrapper": frozenset({_ZERO, _FP16_OPT})},
    # the llama family has its own outputs and no late module
    ("llama", 1): {"leaf": NOTHING, "extra:late_module": NOTHING, "outputs": NOTHING},
    # an across-ranks option exists only where the ZeRO optimizer runs
    ("world", 0): {"wrapper": frozenset({_ZERO, _BF16_OPT})},
    ("world", 1): {"wrapper": frozenset({_ZERO, _BF16_OPT})},
    ("wrapper", _BF16_OPT): {"z3_reduce": frozenset({_NOT_Z3})},
    ("wrapper", _FP16_OPT): {"z3_reduce": frozenset({_NOT_Z3})},
    ("wrapper", _NONE): {"z3_reduce": frozenset({_NOT_Z3})},
}


@cache
def _names() -> list[str]:
    from zerostate.explorer.pairs import DERIVED
    return [p.name for p in POINTS] + [d.name for d in DERIVED]


def _rules_out(k: int, a: int, m: int, b: int, names: list[str]) -> bool:
    """Alternative ``a`` of point ``k`` shows only beside alternatives of point ``m`` other than ``b``."""
    for key in ((names[k], a), (names[k], None)):
        allowed = SHOWS_ONLY.get(key, {}).get(names[m])
        if allowed is not None and b not in allowed:
            return True
    return False


@cache
def undrawable(pair: tuple[int, int, int, int]) -> bool:
    """The strategy cannot draw a scenario taking both alternatives of ``pair`` (`SHOWS_ONLY`)."""
    i, a, j, b = pair
    names = _names()
    return _rules_out(i, a, j, b, names) or _rules_out(j, b, i, a, names)


def check_table() -> None:
    """Every point the table names exists, every alternative index is within its point (raises otherwise)."""
    from zerostate.explorer.pairs import sizes
    names = _names()
    n = dict(zip(names, sizes(), strict=True))
    for (point, alt), beside in SHOWS_ONLY.items():
        if point not in n or (alt is not None and not 0 <= alt < n[point]):
            raise ValueError(f"drawable.SHOWS_ONLY: no alternative {alt} of point {point!r}")
        for other, alts in beside.items():
            if other not in n or any(not 0 <= x < n[other] for x in alts):
                raise ValueError(f"drawable.SHOWS_ONLY[{point!r}, {alt}]: no such alternatives of {other!r}: {alts}")


__all__ = ["SHOWS_ONLY", "check_table", "undrawable"]
