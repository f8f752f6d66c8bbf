"""Where the tracer observes the harness's own network: marks the network calls, the tracer sets.

The network (`zerostate.harness.net`) calls the pair set here around what DeepSpeed's hooks cannot show:
the backward a fused loss runs inside its forward, and every checkpointed block's forward (a recompute
that torch stops early included).  None while no tracer is installed.
"""

PRE_BACKWARD_OBSERVER = None
"""A pair of callables (start(), end()) around the backward made inside forward."""
BLOCK_OBSERVER = None
"""A pair (enter(block), exit(block)) around every checkpointed block's forward."""
