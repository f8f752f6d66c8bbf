"""zerostate.tracing: observing real DeepSpeed's hook lifecycle as zerostate events, without editing
DeepSpeed; every release difference the observation depends on lives in `compat`."""
