"""The explorer's polish: after Hypothesis, simplify a finding's scenario greedily in the strategies' shrink order.

Hypothesis minimises its *choice sequence*, which need not be the simplest scenario: a ZeRO-3 scenario
draws more choices (leaf flags) than a ZeRO-1 one, so without polish a ZeRO-3 bug that also shows under
ZeRO-1 would be reported on ZeRO-1.  `simplified` keeps any one-step simplification (`simplifications`,
most valuable first) that keeps the finding's key and is closer to the simplest scenario
(`distance_from_simplest`): fewer blocks and steps, ZeRO-3, plain trainable blocks, engine.backward, no
extras, default knobs, no training-setup dimension.
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Callable, Generator, Iterator

from zerostate.findings.finding import Finding
from zerostate.model.scenario import _EXTENDED_DEFAULTS, BackwardKind, Checkpoint, ParamKind, Precision, Scenario
from zerostate.targets.interface import Outcome

from zerostate.explorer.exploration_events import Event

RunStep = Callable[[Scenario], Generator[Event, None, Outcome]]
"""Run one scenario (memoised), yielding the events its run causes, returning its outcome."""


def simplified(f: Finding, run: RunStep) -> Generator[Event, None, Finding]:
    """The simplest finding with ``f``'s key that one-step simplifications reach from ``f``, greedily and
    deterministically; the events of the runs it makes are yielded as they happen."""
    from zerostate.model.network import Network
    best, changed = f, True
    while changed:
        changed = False
        scenario = best.scenario
        assert scenario is not None, "an explored finding has its scenario"
        for cand in simplifications(scenario):
            if not _worth_running(cand, scenario, Network):
                continue
            out = yield from run(cand)
            hit = next((g for g in out.findings if g.key == f.key), None)
            if hit is not None:
                best, changed = hit, True
                break
    return best


def _worth_running(cand: Scenario, best: Scenario, network: type) -> bool:
    """A valid scenario with a loss to differentiate, simpler than ``best``."""
    try:
        cand.validate()
        return bool(network(cand).loss_requires_grad) and distance_from_simplest(cand) < distance_from_simplest(best)
    except Exception:  # noqa: BLE001 -- an invalid combination of simplifications is not a candidate
        return False


_STAGE_RANK = {3: 0, 1: 1, 2: 2}
"""Stages in the strategies' shrink order: ZeRO-3 first, then ZeRO-1, ZeRO-2, stage 0 (any other value)."""


def distance_from_simplest(sc: Scenario) -> tuple[int, int, int, int, int]:
    """How far a scenario is from the simplest one, in the strategies' documented shrink order: fewer
    blocks and steps, ZeRO-3, then plain trainable blocks, engine.backward, no extras, default knobs, no
    training-setup dimension."""
    d = Scenario()
    extras = sum((b.checkpoint.value != "none") + (b.norm.value != "trainable") + (b.lin.value != "trainable")
                 + b.leaf for b in sc.blocks)
    extras += sum(m.backward.value != "engine" for _, _, m in sc.micro_steps())
    extras += sum(st.eval_before for st in sc.steps) + sc.fused_head + (not sc.input_requires_grad)
    extras += sum(getattr(sc, k) != getattr(d, k) for k in ("persistence_threshold", "prefetch_bucket_size",
                                                           "reduce_bucket_size"))
    # the training-setup dimensions (precision, offload, options, ...), re-registrations, branches
    extras += len(sc.beyond_model()) + sum(st.reregister for st in sc.steps) + sum(
        bool(m.skip) for _, _, m in sc.micro_steps()) + (sc.world_size > 1)
    extras += sc.optimizer != d.optimizer  # a setup dimension the model represents (not in beyond_model)
    extras += sum(st.save_load for st in sc.steps) * (sc.stage != 3)  # ZeRO-3's is in beyond_model
    return (len(sc.blocks), len(sc.steps), sc.gas, _STAGE_RANK.get(sc.stage, 3), extras)


def simplifications(sc: Scenario) -> Iterator[Scenario]:
    """One-step simplifications of a scenario, most valuable first."""
    if sc.stage != 3:
        yield sc.with_(stage=3)
    for i in range(len(sc.blocks)) if len(sc.blocks) > 1 else ():
        yield sc.with_(blocks=sc.blocks[:i] + sc.blocks[i + 1:])
    for i in range(len(sc.steps)) if len(sc.steps) > 1 else ():
        yield sc.with_(steps=sc.steps[:i] + sc.steps[i + 1:])
    if sc.gas > 1:
        for j in range(sc.gas):
            yield sc.with_(steps=tuple(replace(st, micro=(st.micro[j],)) for st in sc.steps))
    if sc.stage == 2:
        yield sc.with_(stage=1)
    for i, b in enumerate(sc.blocks):
        for ch in ({"checkpoint": Checkpoint.NONE}, {"norm": ParamKind.TRAINABLE}, {"lin": ParamKind.TRAINABLE},
                   {"leaf": False}):
            nb = replace(b, **ch)
            if nb != b:
                yield sc.with_(blocks=sc.blocks[:i] + (nb,) + sc.blocks[i + 1:])
    for i, st in enumerate(sc.steps):
        if st.eval_before:
            yield sc.with_(steps=sc.steps[:i] + (replace(st, eval_before=False),) + sc.steps[i + 1:])
        for j, m in enumerate(st.micro):
            if m.backward is not BackwardKind.ENGINE:
                nm = st.micro[:j] + (replace(m, backward=BackwardKind.ENGINE),) + st.micro[j + 1:]
                yield sc.with_(steps=sc.steps[:i] + (replace(st, micro=nm),) + sc.steps[i + 1:])
    if sc.fused_head:
        yield sc.with_(fused_head=False)
    if not sc.input_requires_grad:
        yield sc.with_(input_requires_grad=True)
    d = Scenario()
    for k in ("persistence_threshold", "prefetch_bucket_size", "reduce_bucket_size"):
        if getattr(sc, k) != getattr(d, k):
            yield sc.with_(**{k: getattr(d, k)})
    yield from setup_simplifications(sc, d)


def setup_simplifications(sc: Scenario, d: Scenario) -> Iterator[Scenario]:
    """The training-setup dimensions back to their plain value, one at a time (a key first seen
    while shrinking another keeps the scenario it was seen in, setup dimensions and all, so polish is
    what simplifies it)."""
    for k, v in _EXTENDED_DEFAULTS.items():
        if k in ("family", "fp32_grad_accum", "loss_scale_power") or getattr(sc, k) == v:
            continue
        if k == "precision":
            yield sc.with_(precision=Precision.FP32, fp32_grad_accum=False, loss_scale_power=8)
        elif k == "lora":
            yield sc.with_(lora=False, modules_to_save=False)
        else:
            yield sc.with_(**{k: v})
    if sc.fp32_grad_accum:
        yield sc.with_(fp32_grad_accum=False)
    if sc.engines_before:
        yield sc.with_(engines_before=())
    for k in ("max_reuse_distance", "max_live_parameters", "width"):
        if getattr(sc, k) != getattr(d, k):
            yield sc.with_(**{k: getattr(d, k)})
    if any(not b.in_optimizer for b in sc.blocks):
        yield sc.with_(blocks=tuple(replace(b, in_optimizer=True) for b in sc.blocks))
    for i, st in enumerate(sc.steps):
        plain = replace(st, reregister=False, frozen=(), save_load=False,
                        micro=tuple(replace(m, retain=False, skip=()) for m in st.micro))
        if plain != st and not st.idle:
            yield sc.with_(steps=sc.steps[:i] + (plain,) + sc.steps[i + 1:])


__all__ = ["RunStep", "simplifications", "simplified", "distance_from_simplest"]
