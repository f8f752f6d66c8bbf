"""The gradient-hook / epilogue state: an immutable record.

Its fields are those of DeepSpeed's ``BackwardHookStateManager``
(``runtime/base_optimizer.py``, 0.18.5 on), so the runtime's implementation and
a traced real engine can be compared with the model field by field.  Releases
before 0.18.5 use only ``remaining`` and ``depth``.

A ``NamedTuple`` rather than a frozen dataclass: the exhaustive checker
creates and hashes millions of these, and ``_replace`` is several times
cheaper than ``dataclasses.replace``.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class HookState(NamedTuple):
    remaining: int = 0
    """``remaining_grad_acc_hooks``: hooks still expected before the epilogue (fallback path)."""
    depth: int = 0
    """``backward_active_depth``: nesting of ``enter_backward``; 0 means no user backward is active."""
    seen: bool = False
    """``backward_seen_this_step``: ``enter_backward`` ran since the last forward."""
    epilogue_ran: bool = False
    """``epilogue_ran_this_backward``."""
    fired: int = 0
    """``hooks_fired_this_backward``."""
    max_expected: int = 0
    """``max_expected_hooks_seen``: the largest expected count seen (reach grows across phases)."""
    cb_queued: bool = False
    """``post_backward_callback_queued``."""
    cb_task: int | None = None
    """``post_backward_callback_graph_task_id``."""
    counted_task: int | None = None
    """zerostate design only: the graph task whose expected count is cached (None: none yet)."""
    deferred: tuple[tuple[str, frozenset[str]], ...] = ()
    """zerostate design only: z3 leaf modules whose hook fired before their parameters' gradients
    accumulated, each with the parameters still awaited (known issue z3-leaf-input-without-grad)."""

    def with_(self, **changes: Any) -> HookState:
        return self._replace(**changes)

    def observable(self) -> dict[str, int | bool]:
        """The fields a refinement test compares (DeepSpeed's public names)."""
        return {
            "remaining_grad_acc_hooks": self.remaining,
            "backward_active_depth": self.depth,
            "backward_seen_this_step": self.seen,
            "hooks_fired_this_backward": self.fired,
            "max_expected_hooks_seen": self.max_expected,
            "post_backward_callback_queued": self.cb_queued,
        }


__all__ = ["HookState"]
