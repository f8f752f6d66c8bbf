"""`ModelTarget`: the model design as a target, so ``explore`` treats it exactly like real DeepSpeed.

``ModelTarget("ds-0.18.7").run(scenario)`` drives one interleaving (PyTorch's CPU
order) of the design with `zerostate.model.explore.run` and checks every spec
on the trace: one `Finding` per violated spec.  Cheap (milliseconds), no torch.
"""

from __future__ import annotations

import time

from zerostate.model.designs import UnknownDesignError, get_design
from zerostate.model.scenario import Scenario

from .base import Outcome, TargetError, spec_findings


class ModelTarget:
    name = "model"
    version = None

    def __init__(self, design: str = "zerostate"):
        try:
            self.design = get_design(design)
        except UnknownDesignError as exc:
            raise TargetError(str(exc)) from None
        self.design_name = self.design.name

    def run(self, scenario: Scenario) -> Outcome:
        from zerostate.model.explore import run as model_run
        t0 = time.perf_counter()
        from zerostate.model.explore import needs_coordinator
        trace = list(model_run(self.design, scenario).events)
        findings = spec_findings(trace, scenario, self.name, None, needs_coordinator(self.design, scenario))
        return Outcome(scenario, trace, None, findings, time.perf_counter() - t0)

    def close(self) -> None:
        pass


__all__ = ["ModelTarget"]
