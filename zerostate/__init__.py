"""zerostate: DeepSpeed ZeRO's hook lifecycle as explicit, checkable state machines.

Import packages:

* ``zerostate.model``   -- scenarios, events, traces and the state-machine designs (pure Python).
* ``zerostate.specs``   -- the properties every correct design must satisfy.
* ``zerostate.targets`` -- things that turn a scenario into a trace: the model, the runtime, real DeepSpeed.
* ``zerostate.runtime`` -- the verified implementation, installable into a live DeepSpeed engine.
* ``zerostate.reports`` -- the reports the commands write (typed models, report.json / report.md, pictures).
* ``zerostate.cli``     -- the ``zerostate`` command.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``zerostate.watch(engine)`` and ``zerostate.WatchCallback``, imported on first use (importing
    zerostate imports no torch)."""
    if name == "watch":
        from zerostate.watcher.watch import watch
        return watch
    if name == "WatchCallback":
        from zerostate.watcher.hf import WatchCallback
        return WatchCallback
    raise AttributeError(f"module 'zerostate' has no attribute {name!r}")
