"""Ablation: a scenario with one of its triggers taken away, for each trigger it has.

A finding no known issue explains is reported as new, even where it is two known mechanisms at once (a second
backward of one forward *and* optimizer offload with a frozen parameter: the update is neither one's
signature).  Replaying it without each trigger in turn (`zerostate replay --ablate`) shows what is left:
no finding, a finding a known issue explains on its own evidence, or the same unexplained one.  The label
stays what the finding's own run shows; the ablation is evidence beside it, never a label.
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Iterator
from typing import Any

from zerostate.model.scenario import Precision, Scenario, ScenarioError

from zerostate.explorer.simplify import setup_simplifications


def _steps(sc: Scenario, **plain: Any) -> Scenario:
    return sc.with_(steps=tuple(replace(st, **plain) for st in sc.steps))


def _micro(sc: Scenario, **plain: Any) -> Scenario:
    return sc.with_(steps=tuple(replace(st, micro=tuple(replace(m, **plain) for m in st.micro)) for st in sc.steps))


def _changed(sc: Scenario, other: Scenario) -> str:
    a, b = sc.to_dict(), other.to_dict()
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in ("steps", "blocks"))
    shown = [(k, getattr(other, k)) for k in keys]
    return ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in shown) or "plain"


def ablations(sc: Scenario) -> Iterator[tuple[str, Scenario]]:
    """``(what was taken away, the scenario without it)`` for each trigger ``sc`` has: a second backward per
    micro-step, each between-step event (hooks re-registered, requires_grad switched, checkpoint round trip,
    idle step, eval forward), branches, the fused head, an input without grad, and each training-setup
    dimension back to its plain value.  Only valid scenarios."""
    micro = [m for _, _, m in sc.micro_steps()]
    out: list[tuple[str, Scenario]] = []
    if any(m.retain for m in micro):
        out.append(("without a second backward per micro-step (retain_graph)", _micro(sc, retain=False)))
    if any(m.skip for m in micro):
        out.append(("without branches (skip)", _micro(sc, skip=())))
    for field, what in (("reregister", "hooks re-registered"), ("frozen", "requires_grad switched off for a step"),
                        ("save_load", "checkpoint round trip"), ("eval_before", "eval forward")):
        if any(getattr(st, field) for st in sc.steps):
            out.append((f"without {what} ({field})", _steps(sc, **{field: type(getattr(sc.steps[0], field))()})))
    if any(st.idle for st in sc.steps) and not all(st.idle for st in sc.steps):
        out.append(("without the idle step", sc.with_(steps=tuple(st for st in sc.steps if not st.idle))))
    if sc.fused_head:
        out.append(("without the fused head", sc.with_(fused_head=False)))
    if not sc.input_requires_grad:
        out.append(("with an input that requires grad", sc.with_(input_requires_grad=True)))
    for cand in setup_simplifications(sc, Scenario()):
        if cand.steps == sc.steps and cand.blocks == sc.blocks:
            out.append((f"with {_changed(sc, cand)}", cand))
    if sc.precision is Precision.FP16 and sc.loss_scale_power != 8:
        out.append(("with loss_scale_power=8", sc.with_(loss_scale_power=8)))
    for what, cand in out:
        try:
            yield what, cand.validate()
        except ScenarioError:
            continue


__all__ = ["ablations"]
