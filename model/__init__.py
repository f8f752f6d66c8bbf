"""zerostate.model: DeepSpeed ZeRO's hook lifecycle as explicit, pure-Python state machines.

Imports neither torch nor deepspeed.  The pieces:

* `scenario`  -- the input of every target (network, config knobs, schedule), JSON in and out;
  `scenario_fields` the enums and records its fields hold;
* `network`   -- names, sizes and autograd reach derived from a scenario;
* `events`    -- the one event vocabulary and `Trace`; `failure` what a spec monitor returns on a violation;
* `driver`    -- a scenario's driver events as DAGs (every linear extension is a legal interleaving);
* `hook_state`, `hook_actions`, `hook_designs` -- the gradient-hook / epilogue half;
* `coordinator_*` -- the ZeRO-3 parameter coordinator half;
* `machine`   -- the single transition function ``step(state, event)``;
* `designs`   -- the registry of designs (values pairing the two halves);
* `explore`   -- running one interleaving, and the reachable state graph.
"""

from .designs import Design, UnknownDesignError, design_for_release, designs, get_design
from .events import Event, EventKind, Trace
from .network import Network
from .scenario import BackwardKind, Block, Checkpoint, MicroStep, ParamKind, Scenario, ScenarioError, TrainStep

__all__ = ["BackwardKind", "Block", "Checkpoint", "Design", "Event", "EventKind", "MicroStep", "Network",
           "ParamKind", "Scenario", "ScenarioError", "Trace", "TrainStep", "UnknownDesignError",
           "design_for_release", "designs", "get_design"]
