"""The scenario's real network and training loop, one job per module (torch, and deepspeed inside functions).

Every function takes a typed `zerostate.model.scenario.Scenario`, parsed once at the process boundary.
`zerostate.harness.repro` embeds these modules verbatim into standalone reproduction scripts, so the
network a finding is reproduced with is byte-for-byte the one the executor ran; they import nothing of
zerostate beyond the pure model's `Scenario` and the tracer's marks.

* `torch_network` -- the blocks network (`Net`: LayerNorm -> Linear blocks, checkpointing, fused head) and
  `build_model` for either family;
* `llama`      -- the tiny Hugging Face Llama family, PEFT LoRA;
* `config`     -- the DeepSpeed config (every numerics-relevant key explicit), parameter groups, the
  oracle's optimizer;
* `fp16`       -- DeepSpeed's loss-scaling algorithm for the oracle, fp16 on the CPU accelerator;
* `schedule`   -- the one training loop over a `Backend`, the inputs;
* `oracle`     -- plain PyTorch as a backend (`TorchBackend`, `oracle_params`);
* `engine`     -- the DeepSpeed engine as a backend (`DeepSpeedBackend`), engines before it, its settings;
* `checkpoint` -- a DeepSpeed checkpoint round trip and its judgement;
* `compare`    -- the oracle's comparison and tolerances;
* `dist`       -- torch.distributed start-up, ranks, this rank's rows of the batch.
"""
