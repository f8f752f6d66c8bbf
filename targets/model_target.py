"""`ModelTarget`: the model design as a target, so ``explore`` treats it exactly like real DeepSpeed.

``ModelTarget("ds-0.18.7").run(scenario)`` drives one interleaving (PyTorch's CPU
order) of the design with `zerostate.model.explore.run` and checks every spec
on the trace: one `Finding` per violated spec.  Cheap (milliseconds), no torch.  A pure function: it has no
worker to start afresh, restart, start ahead or measure (`Target`'s no-ops).
"""

from __future__ import annotations

import time

from typing import Any

from zerostate.model.designs import UnknownDesignError, get_design
from zerostate.model.scenario import Scenario

from zerostate.targets.interface import Outcome, Target, TargetError, known_design, register, spec_findings


class ModelTarget(Target):
    name: str = "model"
    version: str | None = None

    def __init__(self, design: str = "zerostate"):
        try:
            self.design = get_design(design)
        except UnknownDesignError as exc:
            raise TargetError(str(exc)) from None
        self.design_name = self.design.name

    def run(self, scenario: Scenario) -> Outcome:
        from zerostate.model.explore import run as model_run
        t0 = time.perf_counter()
        self.examples += 1
        from zerostate.model.explore import needs_coordinator
        trace = list(model_run(self.design, scenario).events)
        findings = spec_findings(trace, scenario, self.name, None, needs_coordinator(self.design, scenario))
        return Outcome(scenario, trace, None, findings, time.perf_counter() - t0)


def validate(*, deepspeed: str | None = None, deepspeed_path: str | None = None, design: str | None = None,
             **_: Any) -> None:
    """The model kind's options: a design; no DeepSpeed release (``world_size`` is ignored)."""
    if deepspeed or deepspeed_path:
        raise TargetError("--deepspeed / --deepspeed-path apply to the deepspeed target, not the model")
    if design is not None:
        known_design(design)


def build(*, design: str = "zerostate", **_: Any) -> ModelTarget:
    return ModelTarget(design)


register("model", build, validate)

__all__ = ["ModelTarget", "build", "validate"]
