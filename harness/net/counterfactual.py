"""Counterfactual references: the same run trained by plain PyTorch with a known bug's mechanism applied.

A known issue that explains an oracle difference states its bug as a computation on the PyTorch reference
(`MECHANISMS`): which of the step's gradient contributions the step keeps (only the last backward's, without
micro-step 0's earlier backward, without the gradients a backward inside the forward made ...), or what happens
to the step's gradient (a frozen parameter's stale gradient applied again, a zero gradient stepped by Adam, the
update halved where the fp16 loss scale grew ...).  `oracle.oracle_params(sc, mechanisms=...)` trains the run
with those applied from the start, so the trajectory is the bug's own; `findings.oracle_judgement` labels a
difference with a mechanism only when DeepSpeed is as close to that trajectory as a correct DeepSpeed is to
PyTorch, and farther from the correct one.

A step's *contributions* are the gradient each part of it added, in fp32 and unscaled (the master parameters'
units): ``forward`` for what a backward inside a forward added (a fused loss head), ``backward`` for each user
backward, in order, with its micro-step and its index in the micro-step.  At world size > 1 a mechanism that acts
on each rank's gradient apart (`Mechanism.outside_partition`) has each backward's contribution split into the
ranks' shares (`Contribution.ranks`: each rank's rows' gradient over the world size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zerostate.model.scenario import Family, Gather, Offload, Optimizer, Outputs, Precision, Scenario

Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Contribution:
    kind: str
    """``forward`` (a backward inside the forward) or ``backward`` (a user backward)."""
    micro: int
    index: int
    """Its place among the micro-step's user backwards (0 for a forward's)."""
    grads: Grads
    ranks: tuple[Grads, ...] = ()
    """At world size > 1, when a mechanism needs them (`Mechanism.outside_partition`): each rank's share of
    ``grads`` -- the gradient of its rows of the global batch (its own loss) over the world size -- in rank order;
    they sum to ``grads`` up to rounding.  Empty otherwise."""
    pytorch_style: bool = False
    """A user backward made by ``loss.backward()`` (or ``tensor.backward``), not ``engine.backward``: DeepSpeed sees
    it only through its hooks."""
    stuck: bool = False
    """An earlier train step had a PyTorch-style second backward of one forward, which entered DeepSpeed's backward
    and never left it (`stuck_steps`)."""
    order: tuple[str, ...] = ()
    """The parameters in the order this backward accumulated their gradients (their gradient hooks' order), when a
    mechanism needs it (`Mechanism.bucket_tail`); empty otherwise."""


Keep = Callable[[Sequence[Contribution], int], Sequence[Contribution] | None]
"""Which contributions a step keeps (given the step's micro-step count), or None when the mechanism does not act
on the step (nothing in it triggers the bug).  At ZeRO-1/2 a parameter none of the kept contributions reaches is
stepped with a zero gradient (the flat partition steps every parameter), not skipped."""


@dataclass(frozen=True)
class Mechanism:
    """A known bug's computation on the PyTorch reference."""

    name: str
    applies: Callable[[Scenario], bool]
    """Whether the scenario can trigger it at all (only to spare computing a reference that equals the correct
    one; the label comes from the numbers alone)."""
    keep: Keep | None = None
    counts_again: bool = False
    """Its ``keep`` counts a contribution more than once.  Applied after every mechanism that drops contributions,
    whatever the order mechanisms are given in: a contribution lost never reached the accumulation that would
    count it again."""
    gradient: str = ""
    """A transformation of the step's gradient after the contributions: ``stale-frozen`` (a parameter frozen for
    the step, or in a module the step did not use, gets the gradient of the step before again), ``stale-unused``
    (only a parameter of a module the step did not use does), ``stale-idle`` (at a step with no backward every
    parameter does), ``zero-for-frozen`` (a parameter of an optimizer group frozen for the step gets a zero one),
    ``zero-when-idle`` (at a step with no backward every parameter of an optimizer group gets a zero one),
    ``stale-idle-unscaled-again`` (as ``stale-idle``, divided by the fp16 loss scale once more),
    ``stale-frozen-unscaled-again`` (as ``stale-frozen``, divided by the fp16 loss scale once more: ZeRO-1/2 unscale
    the whole offloaded gradient partition in place, the stale slot included), ``overflowed-replayed`` (a step that
    overflows leaves its gradient, scaled and non-finite where it overflowed, in the offloaded partition; a parameter
    the next step gives no gradient -- frozen, or every contribution lost -- is stepped with it, unscaled once:
    no overflow check sees it),
    ``halved-when-scale-grows``, ``unscaled-by-65536``, ``replayed-when-lost`` (a step whose ``keep`` kept nothing
    applies the gradient the step before applied again: what the fp32 partition still holds)."""
    alternatives: str = ""
    """Mechanisms naming the same group here are alternative rules for one piece of DeepSpeed (which of a boundary
    micro-step's backwards it keeps, which outputs divide by gas): a run shows at most one of them, so a sum never
    combines two."""
    initial_zero_step: bool = False
    """The optimizer takes one step with a zero gradient for every parameter before training (Adam's step count and
    bias correction run one step ahead)."""
    loss_unscaled: bool = False
    """fp16: the loss is not multiplied by the scale, the gradient is still divided by it."""
    unit_loss_scale: bool = False
    """fp16: the loss scaler is a static scale of 1 (no scaling, no growth), not the configured dynamic one."""
    own_rows: bool = False
    """At world size > 1: each rank steps with the gradient of its own rows alone (no reduction across ranks)."""
    output_hooks: str = ""
    """Every tensor of the forward's output divides its gradient by gas on its way back (DeepSpeed's output
    backward hooks) instead of the loss being divided once: for ``pytorch-style`` backwards only, or ``all``.  An
    output computed from another (an auxiliary mean of the hidden state, a loss from its logits) then passes two
    hooks."""
    edit_model_only: bool = False
    """An edit of a trained parameter (``gather: edit``) reaches the 16-bit copy forward and backward run on, not the
    fp32 master copy the optimizer steps: the next applied step writes the master (unedited) plus its update back
    over it."""
    zero_grad_ignored: bool = False
    """The loop's ``engine.zero_grad()`` between two backwards of one retained graph (`MicroStep.zero_grad`) clears
    nothing the optimizer steps with: BF16_Optimizer has moved the first backward's gradient into its fp32
    accumulation already, and ``engine.zero_grad`` only sets the parameters' ``.grad`` to None."""
    in_forward_lost_after_unexited: bool = False
    """In the first micro-step of the train step after one whose retained PyTorch-style second backward never exits
    DeepSpeed's backward (`after_unexited_backward`), what a backward inside the forward makes (a fused head's) is
    lost: measured, ZeRO-1 does not move the head at the next step with SGD and moves it by Adam's momentum alone;
    with gas 3 the later micro-steps' are kept."""
    cpu_buffer: bool = False
    """ZeRO-1/2 with optimizer offload: the first backward of the boundary micro-step copies its gradient to the
    fp32 partition; each later backward of the same forward adds the CPU accumulation buffer to its gradient and
    copies the sum back to the buffer (``async_accumulate_grad_in_cpu_via_gpu`` while ``micro_step_id > 0``), and
    nothing clears that buffer between steps.  So the step gets its last backward's gradient plus everything the
    earlier steps' later backwards left in the buffer.  ZeRO-1 runs no gradient hook before the boundary
    micro-step, so ``micro_step_id`` counts its backwards alone at any gas; ZeRO-2's hooks run in every micro-step
    and the step's first backward overwrites the buffer, so only gas 1 carries it over (both measured).  fp16: a
    step that overflows has written its non-finite gradient into the buffer already, so every later step whose
    second backward adds it overflows as well."""
    bucket_tail: str = ""
    """A PyTorch-style second backward of one forward in the boundary micro-step never exits DeepSpeed's backward (no
    epilogue), so the gradients still in the reduce bucket when it ends (`bucket_tail`: from the backward's hook
    order and ``reduce_bucket_size``) are never reduced and its share of them is lost; the ones a full bucket
    reduced during it: ``lost`` (ZeRO-2 with optimizer offload) reach the step with everything before, ``overwritten``
    (ZeRO-1 with optimizer offload and overlap_comm) replace what the step had (the copy into the fp32 partition).
    Measured per parameter against each micro-step's gradient; ZeRO-2 without offload, ZeRO-1 without either, and
    a bucket that holds the whole backward lose that backward whole (`boundary-first-backward-lost`, the same
    numbers)."""
    outside_partition: bool = False
    """At world size > 1, ZeRO-1 with the fp32 gradient accumulation attribute (``grad_accum``): after each
    reduction of the boundary micro-step a rank keeps its gradient of every parameter outside its partition of the
    flat buffer (the reduction's bucket, divided by the world size in place, or the all-reduced value), so a
    further backward in that micro-step adds to it and the next reduction sends it again
    (`reduced_again`)."""


def _backwards(cs: Sequence[Contribution]) -> list[Contribution]:
    return [c for c in cs if c.kind == "backward"]


def _two_in_a_micro(cs: Sequence[Contribution], micro: int | None = None) -> bool:
    return any(c.index >= 1 and (micro is None or c.micro == micro) for c in _backwards(cs))


def _last_backward_only(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """ZeRO-1/2: a second backward of one forward in the boundary micro-step copies its gradient over what the
    step had accumulated; what a backward inside the forward made is kept."""
    if not _two_in_a_micro(cs, micros - 1):
        return None
    last = _backwards(cs)[-1]
    return [c for c in cs if c is last or c.kind == "forward"]


def _last_backward_only_until_stuck(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """ZeRO-1's optimizer with the fp32 ``grad_accum`` attribute (bf16, fp32 accumulation, optimizer offload): as
    `_last_backward_only`, except in the train steps after a never-exited backward (`Contribution.stuck`), whose
    backwards of one forward all reach the step (measured per parameter: both engine backwards)."""
    if any(c.stuck for c in cs):
        return None
    return _last_backward_only(cs, micros)


def _last_backward_only_in_forward_too(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """ZeRO-1/2 with a fused head: as `_last_backward_only`, but what the backward inside the forward made is lost
    with the first backward, so only the last backward reaches the step.  Stated from runs DeepSpeed matches, not
    yet traced in the source (docs/known-issues-provenance.md); `_last_backward_only` keeps the head's in-forward
    gradient, as the runs it matches do."""
    if not _two_in_a_micro(cs, micros - 1):
        return None
    last = _backwards(cs)[-1]
    return [last]


def _earlier_backwards_added_again(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """BF16_Optimizer: each backward of a micro-step adds everything the micro-step's backwards have written into
    the 16-bit ``.grad`` so far to the fp32 accumulation, so an earlier backward of the same forward is counted once
    more by each later one."""
    if not _two_in_a_micro(cs):
        return None
    out: list[Contribution] = [c for c in cs if c.kind == "forward"]
    for micro in sorted({c.micro for c in _backwards(cs)}):
        backs = sorted((c for c in _backwards(cs) if c.micro == micro), key=lambda c: c.index)
        for j in range(len(backs)):
            out.extend(backs[:j + 1])
    return out


def _unexited_backward_lost_before_boundary(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """BF16_Optimizer: a PyTorch-style backward of a forward that had one already, in a micro-step before the
    boundary, enters DeepSpeed's backward and never exits it (no epilogue): its 16-bit ``.grad`` is never added to
    the fp32 accumulation, and the next forward's prologue clears it."""
    lost = [c for c in _backwards(cs) if c.micro < micros - 1 and c.index > 0 and c.pytorch_style]
    return [c for c in cs if c not in lost] if lost else None


def _unexited_backward_lost_at_boundary(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """BF16_Optimizer: the same in the boundary micro-step -- a PyTorch-style second backward of its forward never
    exits DeepSpeed's backward, so the step reads an fp32 accumulation without it; the backwards that exit keep
    BF16_Optimizer's own counting (`_earlier_backwards_added_again`, applied after this one in a sum)."""
    lost = [c for c in _backwards(cs) if c.micro == micros - 1 and c.index > 0 and c.pytorch_style]
    return [c for c in cs if c not in lost] if lost else None


def _unexited_before_boundary(cs: Sequence[Contribution], micros: int) -> bool:
    """A PyTorch-style backward of a forward that had one already, in a micro-step before the boundary: it enters
    DeepSpeed's backward and never exits it, so the boundary micro-step's backwards run with the depth still up."""
    return any(c.micro < micros - 1 and c.index > 0 and c.pytorch_style for c in _backwards(cs))


def _boundary_backwards_only_after_unexited(cs: Sequence[Contribution],
                                            micros: int) -> Sequence[Contribution] | None:
    """ZeRO-1 with a fused head, after an unexited backward before the boundary: the step keeps the boundary
    micro-step's user backwards alone -- the earlier micro-steps' gradients and what the head's backward inside the
    boundary forward made are lost (its epilogue runs there, outside any user backward).  Measured with an
    ``engine.backward`` and a ``loss.backward()`` at the boundary; without the fused head DeepSpeed is right."""
    if not _unexited_before_boundary(cs, micros):
        return None
    return [c for c in _backwards(cs) if c.micro == micros - 1]


def _pytorch_style_lost_after_unexited(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """ZeRO-2 with fp32 gradient accumulation (the ``grad_accum`` attribute, no offload), after an unexited backward
    before the boundary: that backward's share and every PyTorch-style backward of the boundary micro-step are lost;
    the earlier micro-steps' other backwards are kept (measured per contribution: docs/known-issues-provenance.md)."""
    if not _unexited_before_boundary(cs, micros):
        return None
    return [c for c in cs if not (c.kind == "backward" and c.pytorch_style
                                  and ((c.micro < micros - 1 and c.index > 0) or c.micro == micros - 1))]


def _step_lost_after_unexited(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """ZeRO-1 with optimizer offload, after an unexited backward (before the boundary, or in an earlier train step:
    `Contribution.stuck`), and only PyTorch-style backwards in the boundary micro-step: none reaches an epilogue, so
    nothing is copied into the fp32 partition (measured: ``copy_grads_in_partition`` never runs) and the step
    applies what the partition held -- no gradient in the first step, the step before's again later
    (`Mechanism.gradient` ``replayed-when-lost``; measured per parameter, in the step of the unexited backward and
    in the next ones).  An ``engine.backward`` at the boundary runs its own epilogue: DeepSpeed is right then."""
    if not _unexited_before_boundary(cs, micros) and not any(c.stuck for c in cs):
        return None
    if any(c.micro == micros - 1 and not c.pytorch_style for c in _backwards(cs)):
        return None
    return []


def _earlier_user_backwards_lost_after_unexited(cs: Sequence[Contribution],
                                               micros: int) -> Sequence[Contribution] | None:
    """ZeRO-1 with optimizer offload and a fused head, after an unexited backward before the boundary: the step
    keeps the boundary micro-step's user backwards and every in-forward gradient (the head's, which its own backward
    inside each forward made), and loses the earlier micro-steps' user backwards -- with an ``engine.backward`` or a
    ``loss.backward()`` at the boundary (the head's backward in the boundary forward runs an epilogue; without the
    head a ``loss.backward()`` there gets nothing: `_step_lost_after_unexited`).  Measured per parameter against
    each contribution."""
    if not _unexited_before_boundary(cs, micros):
        return None
    return [c for c in cs if c.kind == "forward" or c.micro == micros - 1]


def _in_forward_lost_in_step_of_unexited(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """ZeRO-2 with a fused head, after an unexited backward before the boundary: the step keeps every user backward
    and loses every in-forward gradient of the step (the head's, which its own backward inside each forward made),
    the micro-steps before the unexited backward included.  Measured per parameter against each contribution."""
    if not _unexited_before_boundary(cs, micros) or not any(c.kind == "forward" for c in cs):
        return None
    return [c for c in cs if c.kind != "forward"]


def _micro0_earlier_backward_lost(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """ZeRO-3: ``partition_grads`` copies (does not add) while ``micro_step_id == 0``, so micro-step 0's earlier
    backwards are overwritten by its last."""
    if not _two_in_a_micro(cs, 0):
        return None
    last0 = max(c.index for c in _backwards(cs) if c.micro == 0)
    return [c for c in cs if not (c.kind == "backward" and c.micro == 0 and c.index < last0)]


def _boundary_first_backward_lost(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """A PyTorch-style second backward in the boundary micro-step: its first backward's share is lost."""
    if not _two_in_a_micro(cs, micros - 1):
        return None
    first = next((c for c in _backwards(cs) if c.micro == micros - 1 and c.index == 0), None)
    return [c for c in cs if c is not first] if first is not None else None


def _in_forward_dropped(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """What a backward inside the forward made is wiped before the step (BF16_Optimizer's backward prologue)."""
    return [c for c in cs if c.kind != "forward"] if any(c.kind == "forward" for c in cs) else None


def _middle_micro_steps_dropped(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """Offloaded ZeRO-1/2: only the first and the last micro-step's gradients reach the step."""
    if micros < 3:
        return None
    return [c for c in cs if c.micro in (0, micros - 1)]


def _last_micro_step_only(cs: Sequence[Contribution], micros: int) -> Sequence[Contribution] | None:
    """A caller-owned boundary with offload: each backward's gradient replaces the one before."""
    backs = _backwards(cs)
    if len(backs) < 2:
        return None
    return [backs[-1]]


def bucket_tail(order: Sequence[str], numel: dict[str, int], size: int) -> frozenset[str]:
    """The parameters left in ZeRO-1/2's reduce (ipg) bucket when a backward whose hooks ran in ``order`` ends:
    before adding a gradient that would take the bucket past ``size`` elements it is reduced and emptied
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``), so a gradient larger than the bucket
    is added alone and reduced by the next one."""
    left: list[str] = []
    elements = 0
    for n in order:
        if elements + numel[n] > size:
            left, elements = [], 0
        left.append(n)
        elements += numel[n]
    return frozenset(left)


def unexited_at_boundary(c: Contribution, micros: int) -> bool:
    """A PyTorch-style later backward of the boundary micro-step's forward: it enters DeepSpeed's backward and
    never exits it."""
    return c.kind == "backward" and c.micro == micros - 1 and c.index > 0 and c.pytorch_style


def zero1_owners(groups: Sequence[Sequence[tuple[str, int]]], world: int) -> dict[str, frozenset[int]]:
    """The ranks whose ZeRO-1/2 partition holds some of each parameter: each optimizer group's parameters
    (trainable, with elements: ``(name, numel)`` in the group's order) flattened one after another, padded to a
    multiple of ``2 * world`` (stage_1_and_2.py's ``nccl_start_alignment_factor`` times the data-parallel size;
    without ``parameter_alignment`` or ``round_robin_gradients``, DeepSpeed's defaults) and split into ``world``
    equal partitions; a parameter is in a rank's partition when any of its elements is (``get_partition_info``)."""
    owners: dict[str, frozenset[int]] = {}
    for group in groups:
        total = sum(n for _, n in group)
        size = -(-total // (2 * world)) * 2  # the padded flat buffer over world ranks
        off = 0
        for name, n in group:
            owners[name] = frozenset(r for r in range(world) if off < (r + 1) * size and r * size < off + n)
            off += n
    return owners


def reduced_again(cs: Sequence[Contribution], micros: int, owners: dict[str, frozenset[int]], world: int,
                  all_reduce: bool) -> Grads | None:
    """What ZeRO-1's reductions add to the step's gradient when the boundary micro-step has more than one backward
    and each rank keeps its gradient of the parameters outside its partition (`Mechanism.outside_partition`), or
    None when the step has one reduction.

    Every backward of the boundary micro-step ends in a reduction (``reduce_gradients``); the first sends what
    the step accumulated so far (the earlier micro-steps' and the boundary's first backward), each later one its
    own backward.  A rank's bucket holds its gradient plus what it kept, divided by the world size in place; for a
    parameter in its partition the gradient is then cleared, for any other it is kept: the divided bucket
    (``reduce_scatter``: a reduce to the owner) or, with ``all_reduce`` (``reduce_scatter`` off), the all-reduced
    value.  So each later reduction sends a non-owner's kept value
    over the world size again, on top of the step's correct gradient."""
    boundary = micros - 1
    later = [c for c in cs if c.kind == "backward" and c.micro == boundary and c.index >= 1]
    if not later or world < 2:
        return None
    first = [c for c in cs if not any(c is d for d in later)]
    reductions = [first] + [[c] for c in sorted(later, key=lambda c: c.index)]
    if any(not c.ranks for r in reductions for c in r if c.kind == "backward"):
        return None  # the ranks' shares were not recorded (world size 1)
    names = {n for c in cs for r in c.ranks for n in r}
    extra: Grads = {}
    for n in names:
        outside = [r for r in range(world) if r not in owners.get(n, frozenset(range(world)))]
        if not outside:
            continue
        kept: dict[int, torch.Tensor | None] = dict.fromkeys(range(world))
        for reduction in reductions:
            sent: dict[int, torch.Tensor] = {}
            for r in range(world):
                share = [c.ranks[r][n] for c in reduction if c.ranks and n in c.ranks[r]]
                mine = torch.stack(share).sum(0) if share else None
                before = kept[r]
                if before is not None:
                    add = before / world
                    extra[n] = extra[n] + add if n in extra else add.clone()
                    mine = add if mine is None else mine + add
                if mine is not None:
                    sent[r] = mine
            total = torch.stack(list(sent.values())).sum(0) if sent else None
            for r in range(world):
                kept[r] = None if r not in outside else (total if all_reduce else sent.get(r))
    return extra or None


def offloaded(sc: Scenario) -> bool:
    """The optimizer's state and fp32 gradient partition live on the CPU (``offload_optimizer``)."""
    return sc.offload in (Offload.OPTIMIZER, Offload.BOTH)


def _without_gradient(sc: Scenario) -> bool:
    """Some step leaves a trainable parameter without a gradient: frozen for it, or its module not used in it."""
    return any(s.frozen or s.unused for s in sc.steps)


def _several_outputs(sc: Scenario) -> bool:
    """The forward returns more than one tensor, one computed from another (the blocks' ``(hidden, aux)``, a
    llama's loss and logits)."""
    return sc.outputs is not Outputs.TENSOR or sc.family is Family.LLAMA


def _retains(sc: Scenario) -> bool:
    return any(m.retain for _, _, m in sc.micro_steps())


def _boundary_retains(sc: Scenario) -> bool:
    """Some step's boundary (last) micro-step has two backwards of one forward."""
    return any(s.micro and s.micro[-1].retain for s in sc.steps)


def _first_retains(sc: Scenario) -> bool:
    """Some step's first micro-step has two backwards of one forward."""
    return any(s.micro and s.micro[0].retain for s in sc.steps)


def _unexited_retain_before_boundary(sc: Scenario) -> bool:
    """Some step has a PyTorch-style second backward of one forward before its boundary micro-step (it never exits
    DeepSpeed's backward: `_unexited_before_boundary`)."""
    return any(m.retain and m.backward.pytorch_style for s in sc.steps for m in s.micro[:-1])


def _unexited_retain_at_boundary(sc: Scenario) -> bool:
    """Some step's boundary micro-step has a PyTorch-style second backward of one forward (`unexited_at_boundary`)."""
    return any(s.micro and s.micro[-1].retain and s.micro[-1].backward.pytorch_style for s in sc.steps)


def stuck_steps(sc: Scenario) -> frozenset[int]:
    """The train steps after one with a PyTorch-style second backward of one forward (retained), in any of its
    micro-steps: that backward entered DeepSpeed's backward and never left it."""
    first = next((si for si, step in enumerate(sc.steps)
                  if any(m.retain and m.backward.pytorch_style for m in step.micro)), None)
    return frozenset(range(first + 1, len(sc.steps))) if first is not None else frozenset()


def after_unexited_backward(sc: Scenario) -> frozenset[tuple[int, int]]:
    """``(step, 0)`` for each train step after one with two PyTorch-style backwards of one forward (retained) in a
    micro-step (``loss.backward()`` or a non-scalar ``tensor.backward(grad)``): that second backward enters
    DeepSpeed's backward and, with no epilogue, never leaves it.  Measured:
    the next step's first micro-step loses its in-forward gradient; a later micro-step of the same step (another
    retained one included) and the next step's later micro-steps keep theirs."""
    return frozenset((si + 1, 0) for si, step in enumerate(sc.steps[:-1])
                     if any(m.retain and m.backward.pytorch_style for m in step.micro))


def _zero1_grad_accum_attribute(sc: Scenario) -> bool:
    """ZeRO-1's optimizer with the fp32 ``grad_accum`` attribute at world size > 1, a second backward of one forward:
    bf16 with fp32 accumulation takes the ZeRO optimizer (not BF16_Optimizer) only with optimizer offload
    (engine.py ``_do_optimizer_sanity_check``).  Not with a fused head (the ranks' shares are recomputed by forwards
    that would run its backward again)."""
    return (sc.stage == 1 and sc.world_size > 1 and sc.precision is Precision.BF16 and sc.fp32_grad_accum
            and offloaded(sc) and _retains(sc) and not sc.fused_head)


MECHANISMS: dict[str, Mechanism] = {m.name: m for m in (
    Mechanism("last-backward-only", lambda sc: _boundary_retains(sc) and sc.stage in (1, 2),
              keep=_last_backward_only, alternatives="boundary-backwards"),
    Mechanism("last-backward-only-until-unexited-backward",
              lambda sc: _boundary_retains(sc) and sc.stage == 1 and sc.precision is Precision.BF16
              and sc.fp32_grad_accum and offloaded(sc) and bool(stuck_steps(sc)),
              keep=_last_backward_only_until_stuck, alternatives="boundary-backwards"),
    Mechanism("last-backward-only-in-forward-too",
              lambda sc: _boundary_retains(sc) and sc.stage in (1, 2) and sc.fused_head,
              keep=_last_backward_only_in_forward_too, alternatives="boundary-backwards"),
    Mechanism("unexited-backward-lost-before-boundary",
              lambda sc: _unexited_retain_before_boundary(sc) and sc.bf16_optimizer,
              keep=_unexited_backward_lost_before_boundary),
    Mechanism("earlier-backwards-added-again", lambda sc: _retains(sc) and sc.bf16_optimizer,
              keep=_earlier_backwards_added_again, counts_again=True),
    Mechanism("boundary-backwards-only-after-unexited-backward",
              lambda sc: _unexited_retain_before_boundary(sc) and sc.stage == 1 and not sc.bf16_optimizer
              and sc.fused_head and not offloaded(sc), keep=_boundary_backwards_only_after_unexited),
    Mechanism("step-lost-after-unexited-backward",
              lambda sc: (_unexited_retain_before_boundary(sc) or bool(stuck_steps(sc))) and sc.stage == 1
              and not sc.bf16_optimizer and offloaded(sc), keep=_step_lost_after_unexited,
              gradient="replayed-when-lost"),
    Mechanism("pytorch-style-backwards-lost-after-unexited-backward",
              lambda sc: _unexited_retain_before_boundary(sc) and sc.stage == 2 and sc.precision is Precision.BF16
              and sc.fp32_grad_accum and not offloaded(sc), keep=_pytorch_style_lost_after_unexited),
    Mechanism("earlier-user-backwards-lost-after-unexited-backward",
              lambda sc: _unexited_retain_before_boundary(sc) and sc.stage == 1 and not sc.bf16_optimizer
              and offloaded(sc) and sc.fused_head, keep=_earlier_user_backwards_lost_after_unexited),
    Mechanism("in-forward-lost-in-step-of-unexited-backward",
              lambda sc: _unexited_retain_before_boundary(sc) and sc.stage == 2 and sc.fused_head and offloaded(sc)
              and sc.manual_boundary,
              keep=_in_forward_lost_in_step_of_unexited),
    Mechanism("micro0-earlier-backward-lost", lambda sc: _first_retains(sc) and sc.stage == 3,
              keep=_micro0_earlier_backward_lost),
    Mechanism("boundary-first-backward-lost", _boundary_retains, keep=_boundary_first_backward_lost,
              alternatives="boundary-backwards"),
    # after the other two boundary rules: where they explain as well (one forward's two equal backwards), they name it
    Mechanism("unexited-backward-lost-at-boundary",
              lambda sc: _unexited_retain_at_boundary(sc) and sc.bf16_optimizer,
              keep=_unexited_backward_lost_at_boundary, alternatives="boundary-backwards"),
    Mechanism("bucket-tail-lost-after-unexited-backward",
              lambda sc: _unexited_retain_at_boundary(sc) and sc.stage == 2 and offloaded(sc), bucket_tail="lost"),
    Mechanism("bucket-flushed-overwritten-after-unexited-backward",
              lambda sc: _unexited_retain_at_boundary(sc) and sc.stage == 1 and offloaded(sc) and bool(sc.overlap_comm)
              and not sc.fused_head, bucket_tail="overwritten"),
    Mechanism("in-forward-gradient-dropped", lambda sc: sc.fused_head, keep=_in_forward_dropped),
    Mechanism("in-forward-lost-after-unexited-backward",
              lambda sc: sc.fused_head and sc.stage in (1, 2) and bool(after_unexited_backward(sc)),
              in_forward_lost_after_unexited=True),
    Mechanism("middle-micro-steps-dropped", lambda sc: offloaded(sc) and sc.gas >= 3,
              keep=_middle_micro_steps_dropped),
    Mechanism("last-micro-step-only", lambda sc: offloaded(sc) and sc.manual_boundary, keep=_last_micro_step_only),
    Mechanism("stale-gradient-replayed-when-frozen", lambda sc: offloaded(sc) and _without_gradient(sc),
              gradient="stale-frozen"),
    Mechanism("stale-gradient-unscaled-again-when-frozen",
              lambda sc: offloaded(sc) and sc.stage in (1, 2) and sc.precision is Precision.FP16
              and _without_gradient(sc), gradient="stale-frozen-unscaled-again"),
    Mechanism("overflowed-gradient-replayed",
              lambda sc: offloaded(sc) and sc.stage in (1, 2) and sc.precision is Precision.FP16,
              gradient="overflowed-replayed"),
    Mechanism("stale-gradient-replayed-when-unused",
              lambda sc: sc.stage == 3 and not offloaded(sc) and any(s.unused for s in sc.steps),
              gradient="stale-unused"),
    Mechanism("stale-gradient-replayed-at-idle-step", lambda sc: offloaded(sc) and any(s.idle for s in sc.steps),
              gradient="stale-idle"),
    Mechanism("stale-gradient-unscaled-again-at-idle-step",
              lambda sc: offloaded(sc) and sc.stage == 3 and sc.precision is Precision.FP16
              and any(s.idle for s in sc.steps), gradient="stale-idle-unscaled-again"),
    Mechanism("frozen-stepped-with-zero-gradient",
              lambda sc: sc.optimizer is Optimizer.CONFIG_ADAM and _without_gradient(sc),
              gradient="zero-for-frozen"),
    Mechanism("idle-step-stepped-with-zero-gradient",
              lambda sc: sc.optimizer is Optimizer.CONFIG_ADAM and any(s.idle for s in sc.steps),
              gradient="zero-when-idle"),
    Mechanism("optimizer-state-initialised-by-a-step",
              lambda sc: sc.optimizer is Optimizer.CONFIG_ADAM and sc.fp16_optimizer,
              initial_zero_step=True),
    Mechanism("update-halved-when-scale-grows", lambda sc: sc.precision is Precision.FP16,
              gradient="halved-when-scale-grows"),
    Mechanism("loss-not-scaled", lambda sc: sc.precision is Precision.FP16 and sc.stage == 0, loss_unscaled=True),
    Mechanism("loss-scaler-from-fp32-first-param",
              lambda sc: sc.precision is Precision.FP16 and sc.stage == 3 and sc.zero_init and sc.lora
              and not sc.modules_to_save, unit_loss_scale=True),
    Mechanism("output-hooks-divide-by-gas", lambda sc: sc.gas > 1 and sc.stage in (1, 2) and _several_outputs(sc),
              output_hooks="pytorch-style", alternatives="output-hooks"),
    Mechanism("output-hooks-divide-by-gas-engine-backward",
              lambda sc: sc.gas > 1 and sc.stage in (1, 2) and _several_outputs(sc), output_hooks="all",
              alternatives="output-hooks"),
    Mechanism("update-unscaled-by-65536", lambda sc: sc.precision is Precision.BF16 and sc.stage == 0,
              gradient="unscaled-by-65536"),
    Mechanism("own-rows-only", lambda sc: sc.world_size > 1 and sc.stage in (1, 2), own_rows=True),
    Mechanism("zero1-outside-partition-reduced-again", _zero1_grad_accum_attribute, outside_partition=True),
    Mechanism("offload-cpu-buffer-added-again",
              lambda sc: offloaded(sc) and (sc.stage == 1 or (sc.stage == 2 and sc.gas == 1))
              and _boundary_retains(sc) and not sc.manual_boundary, cpu_buffer=True),
    Mechanism("edit-not-in-master", lambda sc: sc.fp16_optimizer and any(s.gather is Gather.EDIT for s in sc.steps),
              edit_model_only=True),
    Mechanism("zero-grad-not-in-fp32-accumulation",
              lambda sc: sc.bf16_optimizer and any(m.zero_grad for _, _, m in sc.micro_steps()),
              zero_grad_ignored=True),
)}
"""Every mechanism a known issue names (`known.issue.KnownIssue.mechanism`), by name."""


def applicable(sc: Scenario) -> list[str]:
    """The mechanisms the scenario can trigger, in `MECHANISMS`' order."""
    return [name for name, m in MECHANISMS.items() if m.applies(sc)]


__all__ = ["MECHANISMS", "Contribution", "Grads", "Mechanism", "after_unexited_backward", "applicable",
           "bucket_tail", "offloaded", "reduced_again", "stuck_steps", "unexited_at_boundary", "zero1_owners"]
