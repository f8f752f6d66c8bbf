"""zerostate.harness: running a scenario on real DeepSpeed -- the worker and rank-pool processes, the
executor inside them, the network and training loop with its PyTorch oracle, DeepSpeed's releases on disk,
and the standalone repro scripts."""
