"""torch's own machinery the watch observes, patched process-wide while an engine is watched.

* ``torch.utils.checkpoint``'s non-reentrant checkpoint: the recompute (``_run_fn_with_dynamo_disabled``), the
  frozen ZeRO parameters its pack hook saves as themselves, torch's metadata check of the recomputed tensors
  and the backward's unpack -- what seed 002 breaks (`WatchTracer.on_checkpoint` / ``on_recompute``);
* ``torch.autograd.backward``: a PyTorch-style user backward started outside any watched engine's calls.

Installed with the first watched engine (`install_observers`), removed with the last; each event goes to the
tracer whose engine owns the parameter (`ACTIVE`: the watched engines' tracers).
"""

from __future__ import annotations

import functools
import threading
from typing import Any
from collections.abc import Callable

import torch
import torch.utils.checkpoint as _ckpt_module

from zerostate.model.events import EventKind

_ckpt: Any = _ckpt_module
"""torch.utils.checkpoint, whose private classes and methods the observer replaces in place (not the types
its stubs declare)."""

ACTIVE: list[Any] = []
"""The installed `zerostate.watcher.tracer.WatchTracer` s."""
_CKPT_LOCK = threading.Lock()
_CKPT_ORIG: dict[str, Any] = {}
_BWD_ORIG: dict[str, Any] = {}
_ACTIVE = ACTIVE


def install_observers() -> None:
    _install_checkpoint_observer()
    _install_backward_observer()


def uninstall_observers() -> None:
    _uninstall_checkpoint_observer()
    _uninstall_backward_observer()


def _owner(t: object) -> tuple[Any, str] | None:
    for tr in _ACTIVE:
        n = tr.param_names.get(id(t))
        if n is not None:
            return tr, n
    return None


def _saved_frozen(t: object) -> tuple[Any, str] | None:
    """The (tracer, name) of ``t`` when it is a frozen ZeRO parameter a checkpoint keeps as itself."""
    if not isinstance(t, torch.Tensor) or t.requires_grad:
        return None
    return _owner(t)


def _install_checkpoint_observer() -> None:
    """Patch torch.utils.checkpoint once (the names are looked up at call time inside the module)."""
    with _CKPT_LOCK:
        if _CKPT_ORIG:
            return
        needed = ("_recomputation_hook", "_checkpoint_hook", "_CheckpointFrame", "_run_fn_with_dynamo_disabled")
        if not all(hasattr(_ckpt, n) for n in needed):  # another torch: hooks and coordinator still watched
            return
        rec_cls, hook_cls = _ckpt._recomputation_hook, _ckpt._checkpoint_hook
        run_fn, check = _ckpt._run_fn_with_dynamo_disabled, _ckpt._CheckpointFrame.check_recomputed_tensors_match

        # the bases are rec_cls and hook_cls, named through `_ckpt` (Any): a variable is no base class to mypy
        class _WatchedRecomputation(_ckpt._recomputation_hook):
            pack_hook: Callable[[Any], Any]

            def __init__(self, *a: Any, **k: Any) -> None:
                super().__init__(*a, **k)
                inner = self.pack_hook

                @functools.wraps(inner)  # __wrapped__: the runtime's release policy recognises torch's pack hook
                def pack_hook(x: Any) -> Any:
                    hit = _saved_frozen(x)
                    if hit is not None:
                        tr, n = hit
                        tr.on_checkpoint(EventKind.SAVE_LIVE, n)
                    return inner(x)
                self.pack_hook = pack_hook

        class _WatchedCheckpoint(_ckpt._checkpoint_hook):
            unpack_hook: Callable[[Any], Any]

            def __init__(self, *a: Any, **k: Any) -> None:
                super().__init__(*a, **k)
                inner = self.unpack_hook

                @functools.wraps(inner)
                def unpack_hook(holder: Any) -> Any:
                    ret = inner(holder)
                    hit = _saved_frozen(ret)
                    if hit is not None:
                        tr, n = hit
                        tr.on_checkpoint(EventKind.UNPACK, n, "use")
                    return ret
                self.unpack_hook = unpack_hook

        def run_watched(fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
            trs = list(_ACTIVE)
            for tr in trs:
                tr.on_recompute(fn, True)
            try:
                return run_fn(fn, *a, **k)
            finally:
                for tr in trs:
                    tr.on_recompute(fn, False)

        def check_watched(frame: Any, gid: Any) -> Any:
            for t in list(frame.recomputed[gid].values()):
                hit = _saved_frozen(t)
                if hit is not None:
                    tr, n = hit
                    tr.on_checkpoint(EventKind.UNPACK, n, "check")
            return check(frame, gid)

        _CKPT_ORIG.update(_recomputation_hook=rec_cls, _checkpoint_hook=hook_cls, _run_fn_with_dynamo_disabled=run_fn,
                          check=check)
        _ckpt._recomputation_hook = _WatchedRecomputation
        _ckpt._checkpoint_hook = _WatchedCheckpoint
        _ckpt._run_fn_with_dynamo_disabled = run_watched
        _ckpt._CheckpointFrame.check_recomputed_tensors_match = check_watched


def _backward_kind(tensors: Any, grad_tensors: Any) -> str:
    t = tensors[0] if isinstance(tensors, (tuple, list)) and tensors else tensors
    scalar = isinstance(t, torch.Tensor) and t.numel() == 1
    return "torch" if scalar or grad_tensors is None else "nonscalar"


def _install_backward_observer() -> None:
    """Patch ``torch.autograd.backward`` (``Tensor.backward`` calls it) once: a backward the user starts
    outside any watched engine's forward or backward, and outside a running backward (a reentrant
    checkpoint's), is a PyTorch-style user backward (DeepSpeed >= 0.18 runs its epilogue from a post-backward
    callback).  Each engine it reaches opens its window at its first graph task (`WatchTracer.plain_backward_start`) and
    closes it when the call returns."""
    with _CKPT_LOCK:
        if "backward" in _BWD_ORIG:
            return
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(tensors: Any, grad_tensors: Any = None, *a: Any, **k: Any) -> Any:
            trs = []
            if torch._C._current_graph_task_id() == -1 and not any(tr.engine_calls for tr in _ACTIVE):
                trs = list(_ACTIVE)
                kind = _backward_kind(tensors, grad_tensors)
                for tr in trs:
                    tr.plain_backward_start(kind)
            try:
                return original(tensors, grad_tensors, *a, **k)
            finally:
                for tr in trs:
                    tr.plain_backward_end()

        _BWD_ORIG["backward"] = original
        torch.autograd.backward = backward


def _uninstall_backward_observer() -> None:
    with _CKPT_LOCK:
        if "backward" in _BWD_ORIG:
            torch.autograd.backward = _BWD_ORIG.pop("backward")


def _uninstall_checkpoint_observer() -> None:
    with _CKPT_LOCK:
        if not _CKPT_ORIG:
            return
        for name in ("_recomputation_hook", "_checkpoint_hook", "_run_fn_with_dynamo_disabled"):
            setattr(_ckpt, name, _CKPT_ORIG[name])
        _ckpt._CheckpointFrame.check_recomputed_tensors_match = _CKPT_ORIG["check"]
        _CKPT_ORIG.clear()


def checkpointed_module(fn: Callable[..., Any]) -> torch.nn.Module | None:
    """The module a non-reentrant checkpoint recomputes: torch hands `_run_fn_with_dynamo_disabled` its
    ``recompute_fn`` closure over the user's ``fn`` (torch/utils/checkpoint.py
    ``_checkpoint_without_reentrant_generator``); HF's ``GradientCheckpointingLayer`` passes
    ``partial(super().__call__)``, bound to the layer.  None when it is not a module's call (a plain function:
    RECOMPUTE_START then names no region, and ``available-when-used`` exempts nothing in it)."""
    for _ in range(4):
        target = getattr(getattr(fn, "func", fn), "__self__", None)
        if isinstance(target, torch.nn.Module):
            return target
        if isinstance(fn, torch.nn.Module):
            return fn
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if code is None or not cells or "fn" not in code.co_freevars:
            return None
        try:
            fn = cells[code.co_freevars.index("fn")].cell_contents
        except ValueError:  # an empty cell
            return None
    return None


__all__ = ["ACTIVE", "checkpointed_module", "install_observers", "uninstall_observers"]
