"""zerostate.clients: real training jobs as users run them (the Hugging Face ``Trainer``, TRL), which the
tests, the benchmarks and ``zerostate watch`` run under DeepSpeed."""
