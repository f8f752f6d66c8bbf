"""Hypothesis strategies for scenarios: the one module both `generated_tests/` and
``zerostate explore`` draw from, so the command explores exactly what the tests do.

Shrinking goes towards fewer blocks, fewer steps, plain blocks, trainable
parameters, ``engine.backward`` and ZeRO-3 (the first value of each choice).
"""

from __future__ import annotations

from hypothesis import strategies as st

from zerostate.model.network import Network
from zerostate.model.scenario import (BackwardKind, Block, Checkpoint, MicroStep, ParamKind, Scenario,
                                      TrainStep)

CHECKPOINTS = (Checkpoint.NONE, Checkpoint.REENTRANT, Checkpoint.NON_REENTRANT)
BACKWARDS = (BackwardKind.ENGINE, BackwardKind.TORCH, BackwardKind.NONSCALAR)
KINDS = (ParamKind.TRAINABLE, ParamKind.FROZEN, ParamKind.UNUSED)


@st.composite
def blocks(draw, kinds=KINDS, checkpoints=CHECKPOINTS, leaf: bool = True) -> Block:
    return Block(
        checkpoint=draw(st.sampled_from(checkpoints)),
        norm=draw(st.sampled_from(kinds)),
        lin=draw(st.sampled_from(kinds)),
        leaf=draw(st.booleans()) if leaf else False,
    )


@st.composite
def train_steps(draw, gas: int, backwards=BACKWARDS, eval_forwards: bool = True,
                skippable: tuple[int, ...] = (), reregister: bool = False) -> TrainStep:
    """``skippable``: blocks with a frozen norm a micro-step's branch may skip (drawn only when given);
    ``reregister``: also draw whether ZeRO-3's hooks are re-registered before the step."""
    micro = tuple(MicroStep(draw(st.sampled_from(backwards)),
                            tuple(sorted(draw(st.sets(st.sampled_from(skippable))))) if skippable else ())
                  for _ in range(gas))
    return TrainStep(micro=micro, eval_before=draw(st.booleans()) if eval_forwards else False,
                     reregister=draw(st.booleans()) if reregister else False)


@st.composite
def scenarios(draw, *, max_blocks: int = 3, max_steps: int = 2, max_gas: int = 2,
              stages=(3, 1, 2), kinds=KINDS, checkpoints=CHECKPOINTS, backwards=BACKWARDS,
              leaf: bool = True, fused_head: bool = True, eval_forwards: bool = True,
              knobs: bool = True, width: int = 8, branches: bool = False,
              reregister: bool = False) -> Scenario:
    """A trainable scenario: the loss requires grad, so every backward call is legal.

    ``branches``: micro-steps may skip frozen norms (a different branch: the ZeRO-3 module order
    changes); ``reregister``: train steps may start by re-registering ZeRO-3's hooks.  Both are off by
    default so existing draws (and their derandomized examples) are unchanged.
    """
    stage = draw(st.sampled_from(stages))
    bl = tuple(draw(st.lists(blocks(kinds, checkpoints, leaf and stage == 3), min_size=1,
                             max_size=max_blocks)))
    gas = draw(st.integers(1, max_gas))
    skippable = tuple(i for i, b in enumerate(bl) if b.norm is ParamKind.FROZEN) if branches else ()
    steps = tuple(draw(st.lists(train_steps(gas, backwards, eval_forwards, skippable, reregister),
                                min_size=1, max_size=max_steps)))
    sc = Scenario(
        blocks=bl, steps=steps, stage=stage,
        fused_head=draw(st.booleans()) if fused_head else False,
        input_requires_grad=not draw(st.booleans()) if knobs else True,
        width=width,
        persistence_threshold=draw(st.sampled_from((0, width))) if knobs else 0,
        prefetch_bucket_size=draw(st.sampled_from((0, 4 * width * width))) if knobs else 0,
        reduce_bucket_size=draw(st.sampled_from((500_000_000, 2 * width * width))) if knobs else 500_000_000,
    )
    if not Network(sc).loss_requires_grad:
        # Nothing trainable reaches the loss: backward() would raise in plain PyTorch too.
        # Make the last block's Linear trainable and plain instead of discarding the example.
        last = bl[-1]
        sc = sc.with_(blocks=bl[:-1] + (Block(Checkpoint.NONE, last.norm, ParamKind.TRAINABLE, last.leaf),))
    return sc.validate()


__all__ = ["BACKWARDS", "CHECKPOINTS", "KINDS", "blocks", "scenarios", "train_steps"]
