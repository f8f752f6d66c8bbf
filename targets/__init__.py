"""zerostate.targets: things that turn a Scenario into a Trace (the model, the runtime, real DeepSpeed),
and the Hypothesis strategies every explorer draws scenarios from.

Importing the package registers the target kinds (`interface.register`): ``model`` and ``deepspeed``.
Neither registration imports torch or DeepSpeed; the deepspeed kind imports its classes when built."""

from zerostate.targets import model_target as _model_target  # noqa: F401  registers "model"
from zerostate.targets.deepspeed import kind as _deepspeed_kind  # noqa: F401  registers "deepspeed"
