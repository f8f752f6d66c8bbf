"""The `zerostate` backward-hook state machine: a drop-in for DeepSpeed's ``BackwardHookStateManager``.

Written from the model's ``zerostate`` hook design (``zerostate.model.hook_designs.ZEROSTATE``,
built from ``zerostate.model.hook_actions``).  Same attribute and method names as
DeepSpeed's class (``deepspeed/runtime/base_optimizer.py``, 0.18.5 on), so a
``ZeROOptimizer`` can hold one in ``_backward_hook_state`` and every delegating
property and call site keeps working.

What differs from DeepSpeed (0.18.7 .. 0.19.8), transition by transition:

=====================================  ==============================================================
DeepSpeed                              zerostate
=====================================  ==============================================================
``should_refresh_expected_hook_count`` always ``False``: the epilogue never depends on an expected
  True on the first hook of a phase      count, so ``count_used_parameters_in_backward`` is evaluated
                                         zero times per backward (the hook closures of 0.18.7+ gate
                                         the call on this predicate).
``reenter_backward_if_needed``         no-op: the epilogue runs only when the whole backward is
  re-enters after a premature epilogue   over (queued callback) or from ``engine.backward`` itself, so
                                         no later phase can find the depth at 0.
``update_hook_state_and_maybe_run_``   a hook outside any user backward (depth 0: a backward made
``epilogue``: max expected count,        inside forward) does nothing more than bucket its gradient;
  queue the callback, or count down      inside one it makes sure the post-backward callback is queued
  and run the epilogue at 0              and counts the hook (``hooks_fired_this_backward``), O(1).
everything else                        identical (enter/exit/reset/queue/run post hooks)
=====================================  ==============================================================

The autograd engine is reached through a small adapter (`TorchAutograd`), so the
refinement test can drive the very same class with the model's graph tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["MissingTorchInternalsError", "TorchAutograd", "ZerostateBackwardHookState",
           "OBSERVABLE_FIELDS", "observable"]


class MissingTorchInternalsError(RuntimeError):
    """This PyTorch build lacks an autograd internal the zerostate hook state relies on."""


class TorchAutograd:
    """The two autograd-engine entry points the hook state needs, bound once.

    * ``current_graph_task_id()``: ``torch._C._current_graph_task_id`` (-1 outside backward);
    * ``queue_callback(fn)``: ``torch.autograd.Variable._execution_engine.queue_callback``
      (``fn`` runs when the current graph task finishes).
    """

    def __init__(self) -> None:
        import torch

        missing = []
        task_id = getattr(torch._C, "_current_graph_task_id", None)
        if task_id is None:
            missing.append("torch._C._current_graph_task_id")
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        queue = getattr(engine, "queue_callback", None) if engine is not None else None
        if queue is None:
            missing.append("torch.autograd.Variable._execution_engine.queue_callback")
        if missing:
            raise MissingTorchInternalsError(
                "zerostate.runtime needs PyTorch autograd internals that this build "
                f"(torch {torch.__version__}) does not have: {', '.join(missing)}. "
                "The zerostate hook state runs the backward epilogue from a callback queued on the "
                "autograd engine; without these it cannot replace DeepSpeed's hook counting.")
        assert task_id is not None and queue is not None  # else ``missing`` named them
        self.current_graph_task_id: Callable[[], int] = task_id
        self.queue_callback: Callable[[Callable[[], None]], None] = queue


_TORCH: TorchAutograd | None = None


def _torch_autograd() -> TorchAutograd:
    global _TORCH  # noqa: PLW0603 -- built on first use: it probes torch internals that may be missing
    if _TORCH is None:
        _TORCH = TorchAutograd()
    return _TORCH


OBSERVABLE_FIELDS = ("remaining_grad_acc_hooks", "backward_active_depth", "backward_seen_this_step",
                     "hooks_fired_this_backward", "max_expected_hooks_seen", "post_backward_callback_queued")
"""The fields a refinement test compares (``zerostate.model.hook_state.HookState.observable``)."""


def observable(manager: Any) -> dict:
    """The observable fields of a hook-state manager (DeepSpeed's or zerostate's)."""
    return {f: getattr(manager, f) for f in OBSERVABLE_FIELDS}


class ZerostateBackwardHookState:
    """DeepSpeed's ``BackwardHookStateManager`` surface, with the model's ``zerostate`` transitions.

    Attributes (DeepSpeed's names):
        remaining_grad_acc_hooks: kept for compatibility; zerostate never counts down, so it
            stays at the value DeepSpeed set (0).
        backward_active_depth: nesting of ``enter_backward`` (0: no user backward active).
        backward_seen_this_step: ``enter_backward`` ran since the last forward.
        epilogue_ran_this_backward: set by DeepSpeed's epilogue, cleared at each forward.
        hooks_fired_this_backward: gradient hooks that fired inside the user backward.
        max_expected_hooks_seen: always 0 (no expected count is ever computed).
        post_backward_callback_queued / post_backward_callback_graph_task_id: the callback that
            runs the post hooks (the engine's epilogue for a PyTorch-style backward).
    """

    zerostate = True
    """Marker: install() recognises a manager it put in place."""

    def __init__(self, autograd: TorchAutograd | None = None) -> None:
        self._autograd = autograd if autograd is not None else _torch_autograd()
        self.remaining_grad_acc_hooks = 0
        self._grad_acc_post_hooks: list = []
        self.backward_active_depth = 0
        self.backward_seen_this_step = False
        self.epilogue_ran_this_backward = False
        self.hooks_fired_this_backward = 0
        self.max_expected_hooks_seen = 0
        self.post_backward_callback_queued = False
        self.post_backward_callback_graph_task_id: int | None = None

    # ------------------------------------------------------------ conversion
    _STATE = ("remaining_grad_acc_hooks", "backward_active_depth", "backward_seen_this_step",
              "epilogue_ran_this_backward", "hooks_fired_this_backward", "max_expected_hooks_seen",
              "post_backward_callback_queued", "post_backward_callback_graph_task_id")

    @classmethod
    def from_manager(cls, other: Any, autograd: TorchAutograd | None = None) -> ZerostateBackwardHookState:
        """A zerostate manager carrying ``other``'s registered post hooks and current counters."""
        new = cls(autograd)
        new.copy_state_from(other)
        return new

    def copy_state_from(self, other: Any) -> None:
        for name in self._STATE:
            if hasattr(other, name):
                setattr(self, name, getattr(other, name))
        self._grad_acc_post_hooks = list(getattr(other, "_grad_acc_post_hooks", []))

    def copy_state_to(self, other: Any) -> None:
        """Hand the current counters and post hooks back to ``other`` (uninstall)."""
        for name in self._STATE:
            if hasattr(other, name):
                setattr(other, name, getattr(self, name))
        other._grad_acc_post_hooks = list(self._grad_acc_post_hooks)

    # ------------------------------------------------------------ post hooks
    def register_grad_acc_post_hook(self, hook: Callable[[], Any]) -> None:
        """Register a callback to run when the backward is over (the engine's post hook)."""
        self._grad_acc_post_hooks.append(hook)

    def unregister_grad_acc_post_hooks(self) -> None:
        self._grad_acc_post_hooks = []

    def run_grad_acc_post_hooks(self) -> None:
        """``run_post_hooks``: skipped outside a user backward (depth 0), else run every post hook."""
        if self.backward_active_depth == 0:
            return
        for hook in self._grad_acc_post_hooks:
            hook()

    # --------------------------------------------------------- enter / exit
    def enter_backward(self) -> None:
        """``enter_backward_resetting``: the first real entry of a step drops counters polluted by
        backward calls made inside forward; then depth + 1 and remember a backward was seen."""
        if self.backward_active_depth == 0 and not self.backward_seen_this_step:
            self.hooks_fired_this_backward = 0
            self.max_expected_hooks_seen = 0
            self.remaining_grad_acc_hooks = 0
            self.post_backward_callback_queued = False
            self.post_backward_callback_graph_task_id = None
        self.backward_active_depth += 1
        self.backward_seen_this_step = True

    def exit_backward(self) -> None:
        if self.backward_active_depth > 0:
            self.backward_active_depth -= 1

    def reset_for_new_step(self) -> None:
        """``reset_for_new_step`` at ``engine.forward``: per-step counters back to zero."""
        self.backward_seen_this_step = False
        self.hooks_fired_this_backward = 0
        self.max_expected_hooks_seen = 0
        self.epilogue_ran_this_backward = False
        self.post_backward_callback_queued = False
        self.post_backward_callback_graph_task_id = None

    # ------------------------------------------------- the hook-side protocol
    def should_refresh_expected_hook_count(self) -> bool:
        """Never: the epilogue does not depend on an expected hook count."""
        return False

    def reenter_backward_if_needed(self) -> None:
        """Nothing to re-enter: no epilogue can run before the last phase."""
        return None

    def queue_post_backward_callback(self) -> bool:
        """Queue the post hooks on the current graph task, once per backward, inside a user backward."""
        if self.post_backward_callback_queued:
            return True
        if self.backward_active_depth == 0:
            return False
        graph_task_id = self._autograd.current_graph_task_id()
        if graph_task_id == -1:
            return False
        def _run_post_backward():  # looked up when it runs, as DeepSpeed's closure does
            self.run_grad_acc_post_hooks()

        self._autograd.queue_callback(_run_post_backward)
        self.post_backward_callback_queued = True
        self.post_backward_callback_graph_task_id = graph_task_id
        return True

    def update_hook_state_and_maybe_run_epilogue(self, current_expected_count: int = 0) -> None:
        """A gradient (or leaf-module) hook fired and its gradient is bucketed.

        ``current_expected_count`` is accepted for DeepSpeed's call sites and ignored.
        Outside a user backward nothing happens; inside one the callback is (already)
        queued and the hook is counted.  Never runs the epilogue itself.
        """
        if self.backward_active_depth == 0:
            return
        if not self.post_backward_callback_queued:
            self.queue_post_backward_callback()
        self.hooks_fired_this_backward += 1

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in observable(self).items())
        return f"ZerostateBackwardHookState({fields})"
