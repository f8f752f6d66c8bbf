"""zerostate.harness: running a scenario on real DeepSpeed -- the worker and rank-pool processes, the
executor inside them, the network and training loop with its PyTorch oracle, DeepSpeed's releases on disk,
and the standalone repro scripts.

* `process` (one worker process and its pipe), `worker` / `rank_worker` (the two worker programs),
  `worker_loop` (their shared JSON-lines loop and DeepSpeed start-up), `rank_pool` (several ranks);
* `protocol` -- the `TypedDict` payloads that cross those process boundaries;
* `executor` -- one scenario inside a worker: traced engine beside the oracle, torn down after;
* `net/` -- the network, the DeepSpeed config, the training loop and the oracle, one job per module;
* `cross_rank_checks` -- what must agree between the ranks of one example;
* `envs` -- DeepSpeed releases installed per version, a checkout's version and working directory;
* `repro` -- standalone scripts embedding the executor and the checks verbatim.
"""
