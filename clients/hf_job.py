"""A real Hugging Face client: a tiny Llama + LoRA trained by the HF ``Trainer`` under DeepSpeed ZeRO-3.

    python -m zerostate.clients.hf_job --ckpt non_reentrant [--runtime] [--steps 5] [--json OUT]
                                       [--zero KEY=VALUE ...] [--measure] [--device cpu|cuda]
                                       [--dtype fp32|bf16]

The job (DOMAIN.md section 4): a random-init ``LlamaForCausalLM`` (hidden 64, 2 layers, vocab 128,
no download: ``HF_HUB_OFFLINE=1``), PEFT LoRA (r=4 on ``q_proj`` / ``v_proj``: every base weight
frozen), ``gradient_checkpointing_enable`` with ``use_reentrant`` True or False, trained by
``transformers.Trainer`` with a DeepSpeed ZeRO-3 config at DeepSpeed's *defaults* (only the stage,
``gradient_clipping`` -- its default changed in 0.19.5 -- and the HF "auto" batch sizes are set;
``--zero KEY=VALUE`` adds ``zero_optimization`` keys, e.g. ``stage3_max_reuse_distance=0``).

``--runtime`` calls ``zerostate.runtime.patch_deepspeed()`` before the Trainer builds the engine.
One configuration per process (a fresh process group): the caller runs this module in a
subprocess, with an old DeepSpeed release first on ``PYTHONPATH`` when it wants one.

The JSON written (and printed on the last stdout line) holds the DeepSpeed version, the loss of
every step (``repr`` exact floats), a SHA-256 of the trained LoRA weights, the error (type and
message) if training crashed, and with ``--measure`` per step: seconds (wall and this process's CPU), frozen-parameter
all-gathers during backward, and the peak number of frozen elements gathered during backward
(counted by wrapping the engine's parameter coordinator; nothing of DeepSpeed is changed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
import traceback
from typing import Any

HIDDEN, LAYERS, VOCAB, SEQ, BATCH = 64, 2, 128, 16, 4
_MANGLE = "_PartitionedParameterCoordinator__"


def _setup_env(device: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    if "MASTER_PORT" not in os.environ:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        s.close()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)


def ds_config(zero: dict[str, Any] | None = None, dtype: str = "fp32") -> dict[str, Any]:
    """ZeRO-3 at DeepSpeed's defaults: nothing but the stage, clipping and HF's auto batch sizes."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, **(zero or {})},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


class _Tokens:
    """A fixed random token data set (no tokenizer, no download)."""

    def __init__(self, n: int, seed: int = 1) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def build_model(ckpt: str):
    """The tiny Llama with LoRA adapters and gradient checkpointing as a user sets them up."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                      max_position_embeddings=2 * SEQ, tie_word_embeddings=False)
    base = LlamaForCausalLM(cfg)
    if ckpt != "none":
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
        if ckpt == "reentrant":
            base.enable_input_require_grads()  # reentrant checkpoint needs an input that requires grad
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return model


class _Meter:
    """Counts frozen-parameter all-gathers and the gathered frozen elements during backward."""

    def __init__(self, engine: Any) -> None:
        import torch
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.task_id = torch._C._current_graph_task_id
        self.not_available = ZeroParamStatus.NOT_AVAILABLE
        self.frozen = [p for p in engine.module.parameters() if hasattr(p, "ds_id") and not p.requires_grad]
        self.frozen_ids = {id(p) for p in self.frozen}
        self.gathers = 0
        self.peak = 0
        coord = engine.optimizer.parameter_offload.get_param_coordinator()
        gather = getattr(coord, _MANGLE + "all_gather_params")
        fetch = coord.fetch_sub_module
        release = coord.release_sub_module

        def all_gather_params(params, forward, *a, **k):
            if self.task_id() != -1:
                self.gathers += sum(1 for p in params if id(p) in self.frozen_ids)
            return gather(params, forward, *a, **k)

        def fetch_sub_module(module, forward):
            out = fetch(module, forward)
            self._sample()
            return out

        def release_sub_module(module, forward=False):
            self._sample()
            return release(module, forward)

        setattr(coord, _MANGLE + "all_gather_params", all_gather_params)
        coord.fetch_sub_module = fetch_sub_module
        coord.release_sub_module = release_sub_module

    def _sample(self) -> None:
        if self.task_id() == -1:
            return
        n = sum(p.ds_numel for p in self.frozen if p.ds_status != self.not_available)
        self.peak = max(self.peak, n)

    def take(self) -> tuple[int, int]:
        out = (self.gathers, self.peak)
        self.gathers, self.peak = 0, 0
        return out


def _weights_digest(engine: Any) -> str:
    """SHA-256 over every trainable parameter's local partition (world size 1: all of it)."""
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        t = p.ds_tensor[: p.ds_numel] if hasattr(p, "ds_tensor") else p.data.flatten()
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def run(ckpt: str = "non_reentrant", runtime: bool = False, steps: int = 5, zero: dict | None = None,
        measure: bool = False, device: str = "cpu", dtype: str = "fp32", out_dir: str | None = None,
        callbacks: list | None = None) -> dict:
    """Train the job in this process; returns the result record (error included, never raised).
    ``callbacks``: HF ``TrainerCallback`` objects given to the ``Trainer`` (e.g. `zerostate.WatchCallback`)."""
    _setup_env(device)
    import tempfile

    import deepspeed
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    if device == "cpu" and os.environ.get("WORLD_SIZE") == "1":
        try:  # one rank: the shared-memory comm op has nothing to reduce; skip its JIT build (30-90 s)
            import deepspeed.comm.torch as ds_comm_torch

            if hasattr(ds_comm_torch, "build_shm_op"):
                ds_comm_torch.build_shm_op = lambda: None
        except ImportError:
            pass

    result: dict[str, Any] = {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                              "torch": torch.__version__, "ckpt": ckpt, "runtime": runtime, "device": device,
                              "dtype": dtype, "zero": zero or {}, "steps": steps, "losses": []}
    if runtime:
        import zerostate.runtime as zr

        zr.patch_deepspeed()
    transformers.set_seed(0)
    model = build_model(ckpt)
    result["checkpointing"] = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    per_step: list[dict[str, Any]] = []

    class _Trainer(Trainer):
        meter: _Meter | None = None

        def training_step(self, model, inputs, *args, **kwargs):
            if measure and self.meter is None:
                self.meter = _Meter(self.model_wrapped)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = super().training_step(model, inputs, *args, **kwargs)
            value = float(loss.detach().float().cpu())  # also a sync point on CUDA
            row = {"loss": value, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
            if self.meter is not None:
                row["frozen_gathers_in_backward"], row["peak_frozen_elements_in_backward"] = self.meter.take()
            per_step.append(row)
            result["losses"].append(value)
            return loss

    args = TrainingArguments(
        output_dir=out_dir or tempfile.mkdtemp(prefix="zerostate-hf-"), per_device_train_batch_size=BATCH,
        max_steps=steps, learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
        report_to=[], save_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        use_cpu=device == "cpu", bf16=dtype == "bf16", deepspeed=ds_config(zero, dtype))
    trainer = _Trainer(model=model, args=args, train_dataset=_Tokens(steps * BATCH), callbacks=callbacks)
    try:
        trainer.train()
        result["weights_sha256"] = _weights_digest(trainer.model_wrapped)
    except Exception as e:  # noqa: BLE001 -- the job's outcome is data: stock 0.19.2 dies of seed 002
        result["error"] = {"type": type(e).__name__, "message": str(e)[:2000],
                           "traceback": traceback.format_exc()[-4000:]}
    result["per_step"] = per_step
    if runtime:
        import zerostate.runtime as zr

        engine = getattr(trainer, "model_wrapped", None)
        inst = zr.installation(engine) if engine is not None else None
        result["installed"] = inst is not None
        result["release_policy"] = bool(inst and inst.release_policy)
    return result


def _parse_zero(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--zero expects KEY=VALUE, got {item!r}")
        out[key] = json.loads(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zerostate.clients.hf_job", description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", choices=["none", "reentrant", "non_reentrant"], default="non_reentrant")
    ap.add_argument("--runtime", action="store_true", help="zerostate.runtime.patch_deepspeed() first")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                    help="extra zero_optimization key (JSON value), e.g. stage3_max_reuse_distance=0")
    ap.add_argument("--measure", action="store_true", help="count frozen gathers / peak gathered elements")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--watch-callback", action="store_true",
                    help="train with zerostate.WatchCallback() in the Trainer; its violations go into the result")
    ap.add_argument("--json", default=None, help="write the result here too")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    callbacks = None
    if a.watch_callback:
        from zerostate.watcher.hf import WatchCallback
        callbacks = [WatchCallback()]
    result = run(a.ckpt, a.runtime, a.steps, _parse_zero(a.zero), a.measure, a.device, a.dtype, callbacks=callbacks)
    if callbacks:
        cb = callbacks[0]
        result["watch"] = {"engines": len(cb.handles), "violations": [v["spec"] for v in cb.violations],
                           "backwards": sum(h.backwards for h in cb.handles),
                           "steps": sum(h.steps for h in cb.handles), "summary": cb.summary()}
    text = json.dumps(result)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    sys.stdout.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
