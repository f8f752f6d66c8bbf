"""Where the tracer observes the harness's own network: marks the network calls, the tracer sets.

The network (`zerostate.harness.net`) calls the pair set here around what DeepSpeed's hooks cannot show:
the backward a fused loss runs inside its forward, and every checkpointed block's forward (a recompute
that torch stops early included).  None while no tracer is installed.
"""

from collections.abc import Callable
from typing import Any

from zerostate.model.events import EventKind

PRE_BACKWARD_OBSERVER: tuple[Callable[[], None], Callable[[], None]] | None = None
"""A pair of callables (start(), end()) around the backward made inside forward."""
BLOCK_OBSERVER: tuple[Callable[[Any], None], Callable[[Any], None]] | None = None
"""A pair (enter(block), exit(block)) around every checkpointed block's forward."""

LOOP_MARKS = {k.value: k for k in (EventKind.FORWARD_START, EventKind.FORWARD_END, EventKind.REREGISTER,
                                   EventKind.STEP)}
LOOP_MARKS.update(eval_start=EventKind.EVAL_FORWARD_START, eval_end=EventKind.EVAL_FORWARD_END,
                  backward_start=EventKind.USER_BACKWARD_START, backward_end=EventKind.USER_BACKWARD_END)
"""The training loop's marks (`zerostate.tracing.core.TraceCore.mark`; four are named as the event they emit) and
the event each emits."""
