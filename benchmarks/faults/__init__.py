"""Fault injection: a catalogue of small faults of the kinds a pull request introduces into DeepSpeed's ZeRO
code (`catalogue.FAULTS`), applied to a copy of an installed release (`apply`) and explored by
``benchmarks/bench_faults.py``."""
