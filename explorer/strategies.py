"""Hypothesis strategies for scenarios: the one module both `generated_tests/` and
``zerostate explore`` draw from, so the command explores exactly what the tests do.

Shrinking goes towards fewer blocks, fewer steps, plain blocks, trainable
parameters, ``engine.backward`` and ZeRO-3 (the first value of each choice), and for the
training-setup dimensions (`setups`) towards fp32, no clipping, no offload, one parameter
group, no tying / external parameter, a tensor output, one loss, one backward per micro-step, the
blocks family.  The setup dimensions are drawn *after* everything else, and the ones that make every
run fail on the pinned release (`FAILS_EVERY_RUN_RATE`: two backwards per micro-step, a step without
gradient) only in one draw in eight, so they do not hide other findings.  Which draw rates keep each seed
bug within the default budget is a property of the whole derandomized sequence, not of one rate, so each
rate here is the one whose sequence keeps them; tying and the external parameter stay at one in two, the
rate that keeps seed 002 on 0.19.2 in the default budget (what each rate was chosen by:
docs/deepspeed-target.md, draw rates).

Several engines in one process (`engines_before`): in one draw in eight a scenario first runs one
or two other engines (ZeRO-3 first in shrink order) in the same process; drawn last of all, it shrinks to
the plain single engine.

Engine and loop options (`extras`): drawn after everything else, each on its own in one draw
of four (gas 3, a manual accumulation boundary, ``contiguous_gradients`` off, ``overlap_comm`` flipped,
ZeRO-3's all-reduce fetch, a module attached after initialize, ZeRO stage 0, a DeepSpeed-built AdamW); the
llama family's LoRA also draws PEFT's ``modules_to_save``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from zerostate.explorer.choices import Weights, pick
from zerostate.model.network import Network
from zerostate.model.scenario import (BackwardKind, Block, Checkpoint, Family, Gather, MicroStep, Offload, Optimizer,
                                      Outputs, ParamKind, Precision, Scenario, Scheduler, TrainStep)

CHECKPOINTS = (Checkpoint.NONE, Checkpoint.REENTRANT, Checkpoint.NON_REENTRANT)
BACKWARDS = (BackwardKind.ENGINE, BackwardKind.TORCH, BackwardKind.NONSCALAR)
KINDS = (ParamKind.TRAINABLE, ParamKind.FROZEN, ParamKind.UNUSED)
DS_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's defaults (0.18.4 .. 0.19.8): ``stage3_param_persistence_threshold``, ``stage3_prefetch_bucket_size``,
``stage3_max_reuse_distance``, ``stage3_max_live_parameters``."""
DS_PREFETCH_BUCKET_SIZE = 50_000_000
DS_MAX_REUSE_DISTANCE = 1_000_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
PRECISIONS = (Precision.FP32, Precision.FP32, Precision.BF16, Precision.FP16)
"""fp32 twice: half of the draws stay fp32.  fp16 runs on DeepSpeed's CPU accelerator too (the executor tells it
fp16 is supported: `net.allow_fp16_on_cpu`); an fp16 scenario's non-scalar backwards become PyTorch-style ones
(DeepSpeed has no loss-scaled form of a non-scalar backward)."""
LOSS_SCALE_POWERS = (8, 16)
"""fp16's initial loss scale 2**power: 8 (no overflow in these small networks), or DeepSpeed's default 16 --
with DeepSpeed's default clipping 1.0, one fp16 draw in three --, whose scaled gradients overflow fp16 on the
first step of most blocks scenarios (the step is skipped and the scale halves: the loss scaler's overflow
path, checked against the oracle's own loss scaler)."""
CLIPPING = (0.0, 1.0, 0.05)
"""Off, DeepSpeed's default from 0.19.5 (rarely reached by these small gradients), and one that clips."""
ONE_IN_FOUR = st.sampled_from((False,) * 3 + (True,))
"""True in one draw of four; shrinks to False."""
ONE_IN_EIGHT = st.sampled_from((False,) * 7 + (True,))
"""True in one draw of eight; shrinks to False."""
FAILS_EVERY_RUN_RATE = ONE_IN_EIGHT
"""How often a setup dimension that makes every run fail on the pinned release is drawn (``retain``: two
backwards per micro-step; ``idle``: a step without gradient): rarely, so its failure does not hide the other
findings of the scenarios that draw it.  The one-in-eight strategy itself, not a copy: Hypothesis labels a
``sampled_from`` by its values, so a copy would draw the same -- but a reader would not know it."""
class _WorldDraw(int):
    """One of `WORLD2_RATE`'s eight choices: 1 -- several ranks --, or 0 -- world size 1, unless ``across``
    and the scenario chose an option whose bugs show across ranks (`across_ranks`).  An ``int``: the eight
    hash as ``(False,) * 7 + (True,)`` does, and Hypothesis labels a ``sampled_from`` by that hash, so its
    generation -- which splices earlier examples' choices by label -- makes the same choices as with plain
    booleans (a separate strategy for the across-ranks rate, with another label, would change the explorer's
    default sequence)."""

    across: bool

    def __new__(cls, value: int, across: bool) -> _WorldDraw:
        obj = super().__new__(cls, value)
        obj.across = across
        return obj


WORLD2_RATE = st.sampled_from(tuple(_WorldDraw(0, i >= 2) for i in range(7)) + (_WorldDraw(1, True),))
"""How often ``world_size`` 2 is drawn (`scenarios`, ``world2``): one draw in eight (a world-size-2 example costs
about two of world size 1: a rank pool); three in four for a scenario that chose an option whose bugs show
across ranks (`across_ranks`).  Hypothesis's generation is not uniform -- it mutates an example into a run
of near copies, which share their world-size choice --, so a rate gives fewer independent choices than it
looks: three in four is what it takes for the default budget to run a ZeRO-1/2 example with
``contiguous_gradients`` off and no offload at several ranks, where 0.19.8's CPU reduce fix shows (the
counts: docs/deepspeed-target.md, draw rates).  The one draw in eight that gives several ranks to any
scenario gives an across-ranks one four (`_world_size`): so world size 4 is drawn where its collectives carry
something, in one across-ranks scenario of eight, and the sequence of scenarios is the same but for their
world size."""


def across_ranks(sc: Scenario) -> bool:
    """The scenario chose an option whose DeepSpeed bugs showed only across ranks (at world size 1 the
    collectives they break carry nothing): ZeRO-1/2 with ``contiguous_gradients`` off (the non-contiguous
    gradients are reduced by ``buffered_reduce_fallback``, which dropped every CPU bucket before 0.19.8:
    known issue ``zero12-cpu-no-reduce-without-contiguous-gradients``), ZeRO-3's all-reduce fetch (DeepSpeed
    #8158), ZeRO-1
    bf16 with fp32 gradient accumulation (``BF16_Optimizer``'s all-reduce before the last micro-batch's
    gradient, #7985)."""
    return ((sc.stage in (1, 2) and not sc.contiguous_gradients) or (sc.stage == 3 and sc.all_reduce_fetch)
            or (sc.stage == 1 and sc.precision is Precision.BF16 and sc.fp32_grad_accum))


_WORLD_VALUES = (_WorldDraw(0, False), _WorldDraw(0, True), _WorldDraw(1, True))
"""`WORLD2_RATE`'s alternatives, for a steered draw (`choices.pick`): its default counts are 2, 5, 1."""


def _world_size(draw, sc: Scenario, weights: Weights | None = None) -> int:
    """1, 2, or -- the one-in-eight draw for a scenario with an across-ranks option -- 4: the reduce-scatter
    partitions, all-gather padding and persistent-parameter races grow with the ranks, and four is the fewest
    where a rank's partition has neighbours on both sides."""
    w = draw(pick(weights, "world", WORLD2_RATE, _WORLD_VALUES))
    across = w.across and across_ranks(sc)
    if w:
        return 4 if across else 2
    return 2 if across else 1


LEAF_RATE = ONE_IN_FOUR
"""How often a ZeRO-3 block is a z3 leaf module (`blocks`): one in four (a MoE-style choice, rarer than a plain
module).  At one in two the leaf draws crowd seed 002's shape (a plain non-reentrant block with frozen
parameters) out of the default budget; with this rate and the others as they are, every combination of the
bug survey (`goals.SURVEY`, once pinned by a test) is in it.  Any change to a draw shifts the whole
derandomized sequence, so the rates were chosen together (docs/deepspeed-target.md, draw rates)."""


@st.composite
def blocks(draw, kinds=KINDS, checkpoints=CHECKPOINTS, leaf: bool = True, weights: Weights | None = None) -> Block:
    return Block(
        checkpoint=draw(pick(weights, "checkpoint", st.sampled_from(checkpoints), checkpoints)),
        norm=draw(st.sampled_from(kinds)),
        lin=draw(st.sampled_from(kinds)),
        leaf=draw(pick(weights, "leaf", LEAF_RATE, (False, True))) if leaf else False,
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
def setups(draw, sc: Scenario, llama: bool = True, weights: Weights | None = None) -> Scenario:
    """The training-setup dimensions drawn onto a drawn scenario (each shrinks to plain); ``weights``: a steered
    exploration's rates (`choices.pick`)."""
    base = sc
    if llama and draw(pick(weights, "llama", ONE_IN_EIGHT, (False, True))):
        sc = _llama(draw, sc)
    precision = draw(pick(weights, "precision", st.sampled_from(PRECISIONS), (Precision.FP32, Precision.BF16,
                                                                              Precision.FP16)))
    offloads = (Offload.NONE, Offload.OPTIMIZER) + ((Offload.PARAM, Offload.BOTH) if sc.stage == 3 else ())
    changes: dict[str, Any] = {
        "precision": precision,
        "fp32_grad_accum": precision is Precision.BF16 and draw(pick(weights, "fp32_grad_accum", st.booleans(),
                                                                     (False, True))),
        "gradient_clipping": (clip := draw(pick(weights, "clipping", st.sampled_from(CLIPPING), CLIPPING))),
        # no draw of its own (a draw shifts the whole derandomized sequence): DeepSpeed's default initial
        # scale 2**16 goes with DeepSpeed's default clipping 1.0 -- the fp16 user of DeepSpeed's defaults
        "loss_scale_power": 16 if precision is Precision.FP16 and clip == 1.0 else 8,
        "offload": draw(pick(weights, "offload", st.sampled_from(offloads),
                             (Offload.NONE, Offload.OPTIMIZER, Offload.PARAM, Offload.BOTH), range(len(offloads)))),
        "tie": draw(st.booleans()) and sc.blocks[0].lin is not ParamKind.UNUSED,
    }
    # The blocks family's draws, made on the llama path too and discarded there: a path that draws fewer
    # choices is "simpler" to Hypothesis's shrinker (shorter choice sequence), so a shrink would otherwise
    # end on the llama family whenever it reached it.  Draws of a fixed shape whatever the number of blocks
    # (index modulo it), so deleting a block while shrinking leaves the rest of the draw in place.
    out = (draw(st.integers(0, 2)) % len(base.blocks),) if draw(ONE_IN_FOUR) else ()
    family_changes = {
        "param_groups": draw(st.integers(1, 3)),
        "blocks": tuple(b if i not in out else Block(b.checkpoint, b.norm, b.lin, b.leaf, in_optimizer=False)
                        for i, b in enumerate(base.blocks)),
        "external": draw(st.booleans()) and base.blocks[0].lin is not ParamKind.UNUSED,
        "outputs": draw(pick(weights, "outputs", st.sampled_from(_OUTPUTS), _OUTPUTS)),
        "losses": draw(st.integers(1, 2))}
    freezable = [i for i, b in enumerate(base.blocks) if b.lin is ParamKind.TRAINABLE and Network(base.with_(
        blocks=base.blocks[:i] + (Block(b.checkpoint, b.norm, ParamKind.FROZEN, b.leaf),) + base.blocks[i + 1:])
    ).loss_requires_grad]  # freezing it for a step leaves the loss requiring grad
    frozen = [_pick(draw(ONE_IN_FOUR), draw(st.integers(0, 2)), freezable) for _ in base.steps]
    steps = sc.steps
    if sc.family is Family.BLOCKS:
        changes.update(family_changes)
        steps = tuple(TrainStep(s.micro, s.eval_before, s.reregister, frozen=f)
                      for s, f in zip(steps, frozen, strict=False))
    retain = pick(weights, "retain", FAILS_EVERY_RUN_RATE, (False, True))
    steps = tuple(TrainStep(tuple(MicroStep(m.backward, m.skip, retain=draw(retain)) for m in s.micro),
                            s.eval_before, s.reregister, frozen=s.frozen) for s in steps)
    if precision is Precision.FP16:  # DeepSpeed has no loss-scaled non-scalar backward: PyTorch-style instead
        steps = tuple(TrainStep(tuple(MicroStep(BackwardKind.TORCH if m.backward is BackwardKind.NONSCALAR
                                                else m.backward, m.skip, m.retain) for m in s.micro),
                                s.eval_before, s.reregister, frozen=s.frozen) for s in steps)
    # a step with only engine.step()
    if len(steps) > 1 and draw(pick(weights, "idle", FAILS_EVERY_RUN_RATE, (False, True))):
        i = draw(st.integers(0, len(steps) - 1))
        steps = steps[:i] + (TrainStep(tuple(MicroStep() for _ in range(sc.gas)), idle=True),) + steps[i + 1:]
    return sc.with_(steps=steps, **changes)


_OUTPUTS = (Outputs.TENSOR, Outputs.TUPLE, Outputs.DICT)


def _pick(take: bool, k: int, among: list[int]) -> tuple[int, ...]:
    return (among[k % len(among)],) if take and among else ()


def _llama(draw, sc: Scenario) -> Scenario:
    """The same draw on the llama family: one decoder layer per block, HF checkpointing from block 0."""
    ck = sc.blocks[0].checkpoint
    steps = tuple(TrainStep(tuple(MicroStep(m.backward if m.backward is not BackwardKind.NONSCALAR
                                            else BackwardKind.TORCH) for m in s.micro),
                            s.eval_before, s.reregister) for s in sc.steps)
    return Scenario(blocks=(Block(ck),) * min(len(sc.blocks), 2), steps=steps, stage=sc.stage, width=8,
                    family=Family.LLAMA, **LORA[draw(st.sampled_from(range(len(LORA))))],
                    persistence_threshold=sc.persistence_threshold, prefetch_bucket_size=sc.prefetch_bucket_size,
                    reduce_bucket_size=sc.reduce_bucket_size)


LORA: tuple[dict[str, Any], ...] = ({"lora": False}, {"lora": True}, {"lora": True, "modules_to_save": True},
                                    {"lora": True, "modules_to_save": True})
"""The llama family's PEFT wrapping, in shrink order: none, LoRA, LoRA with ``modules_to_save=["lm_head"]`` (in
two of the four, so that the default budget holds ZeRO-3 + modules_to_save, DeepSpeed #8144's shape:
docs/deepspeed-target.md, draw rates)."""

EXTRAS = ("gas3", "manual_boundary", "contiguous_gradients", "overlap_comm", "all_reduce_fetch", "late_module",
          "stage0", "zero_init", "config_adam", "reduce_scatter")
"""Engine and loop options users set (`extras`: each drawn on its own), in draw order:

* ``gas3`` -- three micro-steps per train step (the last one repeated): DeepSpeed #7967 needs gas >= 3;
* ``manual_boundary`` -- ``set_gradient_accumulation_boundary`` with engine gas 1 (two micro-steps at least;
  DeepSpeed #7981);
* ``contiguous_gradients`` -- off (DeepSpeed's default is on; the 0.19.8 CPU reduce fix);
* ``overlap_comm`` -- the opposite of the stage's default (on at ZeRO-1/2, off at ZeRO-3);
* ``all_reduce_fetch`` -- ZeRO-3's ``stage3_use_all_reduce_for_fetch_params`` (DeepSpeed #8158);
* ``late_module`` -- a module attached after ``deepspeed.initialize`` (blocks family; DeepSpeed #8009);
* ``stage0`` -- a ZeRO-1/2 scenario run at ZeRO stage 0 (what HF Trainer runs with ``"stage": 0`` and bf16;
  DeepSpeed #7839), with what stage 0 refuses by design taken out: ``engine.backward`` only (DeepSpeed raises
  "Direct calls to tensor.backward() are not supported ... ZeRO stage 0"), no offload, no fp32 gradient
  accumulation with bf16 ("unsupported mix"); fp16 stays fp16 (drawn as bf16, DeepSpeed's unscaled stage-0
  fp16 loss, known issue ``zero0-fp16-loss-not-scaled``, would not show);
* ``zero_init`` -- ZeRO-3: the model built inside ``deepspeed.zero.Init`` as Hugging Face's ``from_pretrained``
  builds it under ZeRO-3, LoRA adapters made afterwards (DeepSpeed #8072 at world size 2); below ZeRO-3
  (blocks family) the same draw adds a parameter with no elements (`EMPTY_PARAM`).
* ``config_adam`` (one draw in two, `EXTRA_RATE`) -- DeepSpeed builds the optimizer from its config
  (``"optimizer": {"type": "AdamW", ..., "torch_adam": true}``, as HF Trainer's integration writes it) over the
  scenario's parameter groups, instead of
  the client SGD (``Scenario.optimizer``; Adam state under offload / mixed precision, DeepSpeed #7948's path).
* ``reduce_scatter`` (never in the generated sequence, `EXTRA_RATE`; drawn by the pairwise completion,
  `pairs`) -- off at ZeRO-1/2/3: ZeRO-1/2 all-reduce their buckets, ZeRO-3 reduces from its contiguous buffer.

An option that does not apply to the drawn scenario (all-reduce fetch at ZeRO-1/2, a late module on the llama
family) leaves it plain."""


EXTRA_RATE = {"config_adam": st.booleans(), "reduce_scatter": st.just(False)}
"""Options of `EXTRAS` drawn at another rate than one in four.  ``config_adam`` is drawn in one of two: the
appended draw shifts the explorer's whole generated sequence, and one in two is the rate at which the default
budget keeps every combination of ``test_default_explore_sequence_draws_each_combination`` (the lower rates
lost DeepSpeed #7981's and #7839's: docs/deepspeed-target.md, draw rates).  Half the draws keep the client SGD.
``reduce_scatter`` is ``just(False)``: it takes no byte of the generated sequence (which stays the one before the
option existed), and only the completion's forced weights turn it on (`choices.pick`)."""


def extras(draw, sc: Scenario, zero0: bool = True, weights: Weights | None = None) -> Scenario:
    """Each option of `EXTRAS` drawn on its own, in one draw of four (`EXTRA_RATE`: another rate; several may
    combine), applied last of all; each shrinks to off.  (Not one ``sampled_from`` over the options: one option
    per example draws too few of the combinations the bugs need within the default budget.)"""
    on = {opt for opt in EXTRAS if draw(pick(weights, f"extra:{opt}", EXTRA_RATE.get(opt, ONE_IN_FOUR), (False, True)))}
    if "stage0" in on and sc.stage in (1, 2) and zero0:
        steps = tuple(TrainStep(tuple(MicroStep(BackwardKind.ENGINE, m.skip, m.retain) for m in s.micro),
                                s.eval_before, s.reregister, s.idle, s.frozen) for s in sc.steps)
        sc = sc.with_(stage=0, steps=steps, offload=Offload.NONE, fp32_grad_accum=False)
    if on & {"gas3", "manual_boundary"}:
        gas = 3 if "gas3" in on else max(sc.gas, 2)
        steps = tuple(TrainStep(s.micro + (s.micro[-1],) * (gas - len(s.micro)), s.eval_before, s.reregister,
                                s.idle, s.frozen) for s in sc.steps)
        sc = sc.with_(steps=steps, manual_boundary="manual_boundary" in on)
    if "contiguous_gradients" in on:
        sc = sc.with_(contiguous_gradients=False)
    if "overlap_comm" in on and sc.stage != 0:
        sc = sc.with_(overlap_comm=sc.stage != 3)
    if "all_reduce_fetch" in on and sc.stage == 3:
        sc = sc.with_(all_reduce_fetch=True)
    if "late_module" in on and sc.family is Family.BLOCKS:
        sc = sc.with_(late_module=True)
    if "zero_init" in on and sc.stage == 3:
        sc = sc.with_(zero_init=True)
    elif "zero_init" in on and sc.family is Family.BLOCKS:  # `EMPTY_PARAM`: the same draw below ZeRO-3
        sc = sc.with_(empty_param=True)
    if "config_adam" in on:
        sc = sc.with_(optimizer=Optimizer.CONFIG_ADAM)
    if "reduce_scatter" in on and sc.stage != 0:
        sc = sc.with_(reduce_scatter=False)
    # rate 0 in the generated sequence (`just`: no byte of it); the completion's and goals' forced weights draw them
    scheduler = draw(pick(weights, "scheduler", st.just(Scheduler.NONE), SCHEDULERS))
    if scheduler is not Scheduler.USER or sc.optimizer is Optimizer.SGD:  # 'user' schedules a client optimizer
        sc = sc.with_(scheduler=scheduler)
    if draw(pick(weights, "decay_groups", st.just(False), (False, True))):
        sc = sc.with_(decay_groups=True, param_groups=1)  # HF Trainer's two groups replace the drawn ones
    if draw(pick(weights, "unused_in_step", st.just(False), (False, True))):
        sc = _unused_in_last_step(sc)
    if draw(pick(weights, "resume", st.just(False), (False, True))):
        sc = _resumed_before_last_step(sc)
    if draw(pick(weights, "zero_grad", st.just(False), (False, True))):
        sc = _zero_grad_in_last_step(sc)
    gather = draw(pick(weights, "gathered", st.just(Gather.NONE), GATHERS))
    if gather is not Gather.NONE:
        sc = _gathered_in_last_step(sc, gather, draw(pick(weights, "gathered_inside", st.just(False), (False, True))))

    if sc.reduce_bucket_size != 500_000_000 and not sc.steps[-1].resume:  # `SAVE_LOAD`: no draw of its own
        sc = sc.with_(steps=sc.steps[:-1] + (replace(sc.steps[-1], save_load=True),))
    return sc


def _unused_in_last_step(sc: Scenario) -> Scenario:
    """The first trainable Linear used in the steps before and left unused in the last (a step is added when the
    scenario has one): a module used in some steps only, after it had gradients -- what a stale gradient needs to
    show.  Blocks family, a last step with a forward; else unchanged."""
    lin = next((i for i, b in enumerate(sc.blocks) if b.lin is ParamKind.TRAINABLE), None)
    steps = sc.steps if len(sc.steps) > 1 else sc.steps + (replace(sc.steps[0], save_load=False),)
    if sc.family is not Family.BLOCKS or lin is None or steps[-1].idle or lin in steps[-1].frozen:
        return sc
    return sc.with_(steps=steps[:-1] + (replace(steps[-1], unused=(lin,)),))


def _zero_grad_in_last_step(sc: Scenario) -> Scenario:
    """The last step's micro-step made two backwards of one retained graph with ``engine.zero_grad()`` between them
    (separate losses, each stepped on its own); one micro-step per train step, a step with a forward; else
    unchanged."""
    last = sc.steps[-1]
    if sc.gas != 1 or last.idle:
        return sc
    micro = tuple(replace(m, retain=True, zero_grad=True) for m in last.micro)
    return sc.with_(steps=sc.steps[:-1] + (replace(last, micro=micro),))


def _resumed_before_last_step(sc: Scenario) -> Scenario:
    """A resume into a fresh engine before the last step (a step is added when the scenario has one): the state one
    step left behind (master weights, optimizer state, scheduler, loss scale) is what the fresh engine loads."""
    steps = sc.steps if len(sc.steps) > 1 else sc.steps + (replace(sc.steps[0], save_load=False),)
    return sc.with_(steps=steps[:-1] + (replace(steps[-1], resume=True, save_load=False),))


def _gathered_in_last_step(sc: Scenario, gather: Gather, inside: bool) -> Scenario:
    """The loop's own ``GatheredParameters`` in the last step (a step is added when the scenario has one), before its
    first forward or, ``inside``, after its first micro-step's backward: after a step, so an edit meets a trained
    master copy.  An edit needs a block whose Linear is trainable and in the optimizer; an idle last step has no
    inside: else unchanged."""
    steps = sc.steps if len(sc.steps) > 1 else sc.steps + (replace(sc.steps[0], save_load=False),)
    if (gather is Gather.EDIT and sc.edited_block is None) or (inside and steps[-1].idle):
        return sc
    return sc.with_(steps=steps[:-1] + (replace(steps[-1], gather=gather, gather_inside=inside),))


GATHERS = (Gather.NONE, Gather.READ, Gather.EDIT)
"""``gathered``'s alternatives in shrink order (`choices.POINTS`): none, every parameter read, one weight edited."""

SCHEDULERS = (Scheduler.NONE, Scheduler.INITIALIZE, Scheduler.USER)
"""``scheduler``'s alternatives in shrink order (`choices.POINTS`): none, passed to initialize, stepped by the loop."""


EMPTY_PARAM = "the zero_init draw below ZeRO-3"
"""A trainable parameter with no elements, registered last (``empty_param``, blocks family; DeepSpeed #8279 at
ZeRO-1/2, fixed in 0.19.6): drawn by `extras`' ``zero_init`` draw when the scenario is below ZeRO-3, where
``zero_init`` does not apply -- no draw of its own, so the explorer's default sequence is unchanged (a draw
of its own, appended to `EXTRAS`, shifted it and lost combinations of the coverage test at every rate tried:
docs/deepspeed-target.md, draw rates).  Not drawn at ZeRO-3, where every such example would crash on every
release before anything else could show (known issue ``z3-empty-param-not-gathered``, kept on its own
scenario)."""


SAVE_LOAD = "the small reduce bucket"
"""A DeepSpeed checkpoint saved and loaded into the same engine before the last train step (``save_load``;
with one step: before it, the untrained model), as HF Trainer saves every ``save_steps`` and resumes; at ZeRO-3
with the consolidated 16-bit state dict, and at ZeRO-1/2/3 zero_to_fp32's fp32 weights
(`net.DeepSpeedBackend.save_load`).  Applied with the options (`extras`) whenever the scenario drew the small
``reduce_bucket_size`` (shrinking the bucket to DeepSpeed's default removes it, and so does polish).  It takes
no draw of its own, as `EDGES` do not: an option of `EXTRAS` drawn on its own shifted the derandomized
sequence, and every rate tried lost a combination of the explore-sequence coverage test or drew scenarios the
zerostate design's own small explore flags for another reason.  A checkpoint costs a few milliseconds per
example, so coupling it to a common draw is cheap (the rates tried and the cost:
docs/deepspeed-target.md, draw rates)."""


ENGINES_BEFORE = ((3,), (1,), (2,), (3, 3), (3, 1), (3, 2), (1, 3), (2, 3))
"""The engines a scenario may run before its own, in shrink order: one ZeRO-3 engine first (the one that
changes process-wide state, ``torch.nn.functional.linear``), then one of ZeRO-1/2, then two."""


def engines_before(draw, weights: Weights | None = None) -> tuple[int, ...]:
    """``engines_before``: () in seven draws of eight, else one of `ENGINES_BEFORE`; shrinks to (), then to
    one ZeRO-3 engine.  One choice per example (a ``sampled_from``), so the dimension shifts the
    derandomized sequence of the other draws as little as a draw can: a list draw (a flag, a length, the
    stages) shifted it enough to lose a combination of the 400-draw coverage test
    (docs/deepspeed-target.md, draw rates)."""
    return draw(pick(weights, "engines_before", st.sampled_from(((),) * 7 * len(ENGINES_BEFORE) + ENGINES_BEFORE),
                     ((),) + ENGINES_BEFORE))


EDGES = {"prefetch_bucket_size": (0, 1), "max_live_parameters": ("w*w", 0)}
"""The ZeRO-3 knob edges the model once got wrong, drawn by default at the odd width 7 (half the setup draws):
``stage3_prefetch_bucket_size`` 1 instead of 0, ``stage3_max_live_parameters`` 0 instead of w*w.  They take no
draw of their own: any extra draw (or a longer ``sampled_from``) shifts the whole derandomized sequence, and
the sequences tried that way lost seed 002 on 0.19.2 within the default budget
(docs/deepspeed-target.md, draw rates); coupled to the width draw, the sequence of every other choice is the
one before.  Shrinking the width to 8 removes them."""


def _edge(value, plain, edge, odd: bool):
    return edge if odd and value == plain else value


@st.composite
def scenarios(draw, *, max_blocks: int = 3, max_steps: int = 2, max_gas: int = 2,
              stages=(3, 1, 2), kinds=KINDS, checkpoints=CHECKPOINTS, backwards=BACKWARDS,
              leaf: bool = True, fused_head: bool = True, eval_forwards: bool = True,
              knobs: bool = True, width: int = 8, branches: bool = True,
              reregister: bool = True, setup: bool = True, llama: bool = True,
              several_engines: bool = True, options: bool = True, zero0: bool = True,
              world2: bool = True, weights: Weights | None = None) -> Scenario:
    """A trainable scenario: the loss requires grad, so every backward call is legal.

    ``branches``: micro-steps may skip frozen norms (a different branch: the ZeRO-3 module order
    changes); ``reregister``: train steps may start by re-registering ZeRO-3's hooks (TRL's generation);
    ``setup``: the training-setup dimensions (`setups`: precision, clipping, offload, parameter groups,
    tying, external parameters, outputs, losses, retain_graph, steps without gradient, requires_grad
    changes, a width of 7 -- not divisible by world size 2 -- and, with ``llama``, the Hugging Face
    Llama family, with LoRA and ``modules_to_save``); ``several_engines`` (with ``setup``): other engines
    run first in the same process (`engines_before`); ``options`` (with ``setup``): the options of `EXTRAS`,
    each on its own (gas 3, a manual accumulation boundary, ZeRO knobs, a module attached late, stage 0);
    ``zero0``: the ``stage0`` option may apply (the model-based tests turn it off: stage 0 has no hook
    manager, and the model's hook machine is ZeRO-1/2/3's); ``world2`` (with ``options``): world size 2 in
    one draw of eight, 4 for some across-ranks options (`_world_size`), drawn last of all (shrinks to 1; a
    world-size-1 target runs it on a rank pool of its own: what only several ranks show -- gradient averaging,
    all-gathers across ranks -- is reached by the default exploration, at about twice the cost of a
    world-size-1 example at 2 ranks).  All on by default:
    ``zerostate explore`` draws every dimension.
    """
    stage = draw(pick(weights, "stage", st.sampled_from(stages), stages))
    bl = tuple(draw(st.lists(blocks(kinds, checkpoints, leaf and stage == 3, weights), min_size=1,
                             max_size=max_blocks)))
    gas = draw(st.integers(1, max_gas))
    skippable = tuple(i for i, b in enumerate(bl) if b.norm is ParamKind.FROZEN) if branches else ()
    steps = tuple(draw(st.lists(train_steps(gas, backwards, eval_forwards, skippable, reregister),
                                min_size=1, max_size=max_steps)))
    sc = Scenario(
        blocks=bl, steps=steps, stage=stage,
        fused_head=draw(st.booleans()) if fused_head else False,
        input_requires_grad=not draw(st.booleans()) if knobs else True,
        width=(w := width if not setup else draw(st.sampled_from((width, width - 1)))),
        # each ZeRO-3 knob: 0 / a value between these parameters' sizes / DeepSpeed's default
        persistence_threshold=draw(pick(weights, "persistence", st.sampled_from(
            (0, width, DS_PERSISTENCE_THRESHOLD)), (0, width, DS_PERSISTENCE_THRESHOLD))) if knobs else 0,
        # at the odd width (setup), the knob edges instead of 0 / w*w: a prefetch bucket of 1 (smaller
        # than any parameter) and max live 0 (nothing prefetched) -- no draw of their own, see `EDGES`
        prefetch_bucket_size=_edge(draw(st.sampled_from((0, 4 * width * width, DS_PREFETCH_BUCKET_SIZE))), 0, 1,
                                   w != width) if knobs else 0,
        max_reuse_distance=draw(st.sampled_from((DS_MAX_REUSE_DISTANCE, 0, 2 * width * width))) if knobs
        else DS_MAX_REUSE_DISTANCE,
        max_live_parameters=_edge(draw(st.sampled_from((DS_MAX_LIVE_PARAMETERS, width * width))), width * width, 0,
                                  w != width) if knobs
        else DS_MAX_LIVE_PARAMETERS,
        # the third, one Linear weight exactly (a bucket filled to its size), only where the completion forces it
        reduce_bucket_size=draw(pick(weights, "reduce_bucket", st.sampled_from((500_000_000, 2 * width * width)),
                                     (500_000_000, 2 * width * width, w * w))) if knobs else 500_000_000,
    )
    if not Network(sc).loss_requires_grad:
        # Nothing trainable reaches the loss: backward() would raise in plain PyTorch too.
        # Make the last block's Linear trainable and plain instead of discarding the example.
        last = bl[-1]
        sc = sc.with_(blocks=bl[:-1] + (Block(Checkpoint.NONE, last.norm, ParamKind.TRAINABLE, last.leaf),))
    if setup:
        sc = draw(setups(sc, llama, weights))
        if several_engines:
            sc = sc.with_(engines_before=engines_before(draw, weights))
        if options:
            sc = extras(draw, sc, zero0, weights)
            ws = _world_size(draw, sc, weights) if world2 else 1
            if ws > 1:
                sc = sc.with_(world_size=ws)
    return sc.validate()


__all__ = ["BACKWARDS", "CHECKPOINTS", "CLIPPING", "ENGINES_BEFORE", "EXTRAS", "LORA", "extras", "KINDS", "PRECISIONS",
           "blocks", "engines_before", "scenarios", "setups", "train_steps"]
