"""zerostate.targets: things that turn a Scenario into a Trace (the model, the runtime, real DeepSpeed),
and the Hypothesis strategies every explorer draws scenarios from."""
