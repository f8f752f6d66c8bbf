"""zerostate.runtime: the verified `zerostate` design, shipped into real DeepSpeed.

* `ZerostateBackwardHookState` -- a drop-in for DeepSpeed's ``BackwardHookStateManager``
  implementing the model's ``zerostate`` hook design: the epilogue runs only from the
  post-backward callback queued on the autograd engine or from ``engine.backward``;
  gradient hooks only bucket, and ``count_used_parameters_in_backward`` is never evaluated.
* the ZeRO-3 recompute release policy (`release_policy`): a frozen parameter fetched during an
  activation-checkpoint recompute stays gathered exactly until its module's backward (the last
  use of the saved tensor), or is released at once when nothing of it was saved.
* `install(engine)` / `uninstall(engine)`; `patch_deepspeed()` installs into every engine that
  ``deepspeed.initialize`` builds (HF Trainer / accelerate), `unpatch_deepspeed()` undoes it.

Files: `install` (install / uninstall, every change through one `patcher.Patcher`), `initialize_patch`
(`patch_deepspeed`), `compat_table` (supported releases), `engine_support`, `hook_closures` (the
gradient-hook closures of 0.18.5 / 0.18.6 and their replacement), `hook_state_manager`, `release_policy`,
`errors`, `autoinstall`, `selfcheck`.

Importing this package imports neither torch nor deepspeed (nor the explorer's hypothesis, networkx,
Pillow: a runtime user installs only torch + deepspeed); `install` imports them.  Logs go to the
``zerostate.runtime`` logger: one INFO line per install, one WARNING per engine left stock.
"""

from .hook_state_manager import (OBSERVABLE_FIELDS, MissingTorchInternalsError, TorchAutograd,
                                 ZerostateBackwardHookState, observable)
from .compat_table import COMPAT, supported_range
from .engine_support import engine_support
from .errors import UnsupportedDeepSpeedError, UnsupportedEngineError, ZerostateInstallError
from .initialize_patch import patch_deepspeed, unpatch_deepspeed
from .install import Installation, install, installation, is_installed, uninstall

__all__ = ["COMPAT", "Installation", "MissingTorchInternalsError", "OBSERVABLE_FIELDS", "TorchAutograd",
           "UnsupportedDeepSpeedError", "UnsupportedEngineError", "ZerostateBackwardHookState",
           "ZerostateInstallError", "engine_support", "install", "installation", "is_installed", "observable",
           "patch_deepspeed", "supported_range", "uninstall", "unpatch_deepspeed"]
