"""`patch_deepspeed`: every engine ``deepspeed.initialize`` builds gets `install` (HF Trainer, accelerate).

``deepspeed.initialize`` is replaced through a `Patcher` (so `unpatch_deepspeed` puts the identical
function back) by a wrapper that installs the runtime into each ZeRO engine it returns.  The runtime
never breaks the user's ``initialize``: an engine `install` refuses, or any failure inside it, is one
WARNING on the ``zerostate.runtime`` logger and the engine stays stock.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from .compat_table import compat_row
from .errors import ZerostateInstallError
from .hook_state_manager import MissingTorchInternalsError, TorchAutograd
from .install import Installation, install, uninstall
from .patcher import Patcher

log = logging.getLogger("zerostate.runtime")


class _Patch:
    """``deepspeed.initialize`` replaced: the install options and the engines installed into."""

    def __init__(self, kwargs: dict) -> None:
        self.kwargs = kwargs
        self.engines: weakref.WeakSet[Any] = weakref.WeakSet()
        self.patcher = Patcher()


_PATCH: _Patch | None = None
_LOCK = threading.RLock()
"""Guards `_PATCH` (`install` has its own lock)."""


def _is_zero_engine(engine: Any) -> bool:
    return getattr(getattr(engine, "optimizer", None), "_backward_hook_state", None) is not None


def _log_install(engine: Any, inst: Installation) -> None:
    """With ``ZEROSTATE_RUNTIME_LOG=<path>``, append one line per engine patch_deepspeed installed into."""
    import os

    path = os.environ.get("ZEROSTATE_RUNTIME_LOG")
    if not path:
        return
    stage_of = getattr(engine, "zero_optimization_stage", None)
    stage = stage_of() if callable(stage_of) else "?"
    try:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} deepspeed={inst.version} stage={stage} release_policy={inst.release_policy} "
                    f"closures_replaced={len(inst.swaps)}\n")
    except OSError as e:
        log.warning("zerostate.runtime: cannot append to ZEROSTATE_RUNTIME_LOG=%s: %s", path, e)


def _install_or_warn(engine: Any, patch: _Patch) -> Installation | None:
    """install() for an engine ``deepspeed.initialize`` built: a refusal, or any failure, is a
    warning and the engine stays stock -- the runtime never breaks the user's ``initialize``."""
    try:
        inst = install(engine, **patch.kwargs)
    except ZerostateInstallError as e:
        log.warning("zerostate.runtime not installed; this engine runs stock DeepSpeed: %s", e)
        return None
    except Exception as e:
        log.warning("zerostate.runtime not installed (unexpected %s: %s); this engine runs stock DeepSpeed",
                    type(e).__name__, e, exc_info=True)
        return None
    patch.engines.add(engine)
    _log_install(engine, inst)
    return inst


def patch_deepspeed(**install_kwargs: Any) -> contextlib.AbstractContextManager[None]:
    """Make every engine ``deepspeed.initialize`` builds get `install` (for trainers that build it).

    Usable as a plain call (``zerostate.runtime.patch_deepspeed()`` before ``Trainer(...)``) or
    as a context manager (restores ``deepspeed.initialize`` on exit).  Checks the DeepSpeed
    release first: an unsupported one raises here, before ``deepspeed.initialize`` is touched.
    Engines without a ZeRO optimizer are returned untouched; an engine `install` refuses
    (`engine_support`) gets one warning on the ``zerostate.runtime`` logger and stays stock.
    """
    global _PATCH  # noqa: PLW0603 -- one patch per process, set and cleared under _LOCK
    import deepspeed

    compat_row(deepspeed.__version__)
    try:
        TorchAutograd()
    except MissingTorchInternalsError as e:
        raise ZerostateInstallError(str(e)) from None
    with _LOCK:
        if _PATCH is None:
            original = deepspeed.initialize
            patch = _Patch(install_kwargs)

            @functools.wraps(original)
            def initialize(*args, **kwargs):
                result = original(*args, **kwargs)
                engine = result[0] if isinstance(result, tuple) else result
                if _is_zero_engine(engine):
                    _install_or_warn(engine, patch)
                return result

            initialize.__zerostate_original__ = original  # type: ignore[attr-defined]
            patch.patcher.set(deepspeed, "initialize", initialize)
            _PATCH = patch
    return _patch_context()


@contextlib.contextmanager
def _patch_context() -> Iterator[None]:
    try:
        yield
    finally:
        unpatch_deepspeed()


def unpatch_deepspeed(uninstall_engines: bool = False) -> bool:
    """Restore ``deepspeed.initialize``; optionally uninstall from the engines it built."""
    global _PATCH  # noqa: PLW0603 -- one patch per process, set and cleared under _LOCK
    with _LOCK:
        patch = _PATCH
        if patch is None:
            return False
        patch.patcher.undo()
        _PATCH = None
        if uninstall_engines:
            for e in list(patch.engines):
                uninstall(e)
        return True


__all__ = ["patch_deepspeed", "unpatch_deepspeed"]
