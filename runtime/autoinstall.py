"""Install the runtime into every engine a process builds, without touching its code.

``enable()`` calls `patch_deepspeed` as soon as ``deepspeed`` is imported (at once if it
already is): every engine ``deepspeed.initialize`` returns then gets `install`.  Meant for
processes one cannot edit -- DeepSpeed's own unit tests, a launcher's workers, the
real-DeepSpeed exploration's worker -- through a ``sitecustomize.py`` on ``PYTHONPATH``::

    # sitecustomize.py
    import os
    if os.environ.get("ZEROSTATE_RUNTIME") == "1":
        from zerostate.runtime.autoinstall import enable
        enable()

``benchmarks/run_deepspeed_unit_tests.sh`` writes exactly that file.  With
``ZEROSTATE_RUNTIME_LOG=<path>`` each install appends one line
``<pid> <deepspeed version> <engine class> stage=<n> release_policy=<bool> closures=<n>``,
so a run can prove the runtime really was in place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading

__all__ = ["after_deepspeed_import", "enable"]

_ENABLED = threading.Event()
_PENDING: list = []
"""Callbacks waiting for ``import deepspeed`` to finish (`after_deepspeed_import`)."""
_LOCK = threading.Lock()


def _patch_now() -> None:
    """Patch; an unsupported DeepSpeed or PyTorch is a warning, never an error from ``import deepspeed``."""
    patch = importlib.import_module(__package__ + ".initialize_patch")
    try:
        patch.patch_deepspeed()
    except patch.ZerostateInstallError as e:
        patch.log.warning("zerostate.runtime autoinstall: deepspeed.initialize left stock: %s", e)


class _Finder(importlib.abc.MetaPathFinder):
    """Wait for ``import deepspeed`` to finish, then run the pending callbacks.

    It stays on ``sys.meta_path`` until deepspeed's module code has run: transformers, accelerate and TRL call
    ``importlib.util.find_spec("deepspeed")`` at import time without importing it, and a finder that left at
    the first lookup would never see the real import."""

    _busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec("deepspeed")
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        finder = self

        def exec_and_run(module):
            exec_module(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            with _LOCK:
                callbacks = list(_PENDING)
                _PENDING.clear()
            for cb in callbacks:
                cb()

        loader.exec_module = exec_and_run  # type: ignore[method-assign]
        return spec


def after_deepspeed_import(callback) -> None:
    """Run ``callback()`` now if ``deepspeed`` is imported, else right after ``import deepspeed`` finishes (one
    import hook for every caller: the runtime's `enable`, ``zerostate watch``'s
    `zerostate.watcher.watch.enable`)."""
    if "deepspeed" in sys.modules:
        callback()
        return
    with _LOCK:
        first = not _PENDING
        _PENDING.append(callback)
        if first:
            sys.meta_path.insert(0, _Finder())


def enable() -> None:
    """Patch ``deepspeed.initialize`` now, or as soon as ``deepspeed`` has been imported."""
    if _ENABLED.is_set():
        return
    _ENABLED.set()
    after_deepspeed_import(_patch_now)
