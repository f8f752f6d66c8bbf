"""Real TRL clients: a tiny Llama + LoRA trained by TRL's `SFTTrainer`, `GRPOTrainer` or `DPOTrainer` under ZeRO-3.

    python -m zerostate.clients.trl_job --trainer sft|grpo|dpo [--ckpt trl|reentrant|non_reentrant|none]
                                        [--import-order trl-first|deepspeed-first] [--steps 3]
                                        [--ds-config trainer|launcher] [--runtime] [--json OUT]

The job as a TRL user writes it: the model and tokenizer are built locally (no download, ``HF_HUB_OFFLINE=1``:
a random-init ``LlamaForCausalLM`` of `zerostate.clients.hf_job`'s size and a word-level tokenizer), LoRA
(r=4 on ``q_proj`` / ``v_proj``) through ``peft_config``, ``gradient_checkpointing=True``, and DeepSpeed ZeRO-3
at DeepSpeed's defaults through ``<Trainer>Config(deepspeed=...)`` (``--ds-config launcher``: no ``deepspeed=``,
the DeepSpeed plugin of ``accelerate launch --config_file`` supplies it).

``--ckpt trl``: TRL's own choice.  TRL 1.16 "forces" ``use_reentrant=True`` with PEFT + ZeRO-3 + checkpointing
(and logs so) by writing ``args.gradient_checkpointing_kwargs``; transformers 5.2x's Trainer reads
``activation_checkpointing_kwargs`` (the old name is a copy made when the arguments were built), so where TRL
rebinds the old name the job runs the model's default, non-reentrant -- ``zerostate watch`` reports what ran.
``reentrant`` / ``non_reentrant`` set both names after the trainer is built and before ``train()`` (where the
Trainer enables checkpointing); non-reentrant is the job that meets seed 002 on 0.19.0-0.19.2.

``--import-order trl-first`` imports trl (and with it transformers, accelerate, peft; each asks
``importlib.util.find_spec("deepspeed")``) before deepspeed, as a TRL script does; ``deepspeed-first`` imports
deepspeed first.  The result (printed as the last stdout line, JSON): DeepSpeed / TRL versions, the
checkpointing (``use_reentrant``: what the Trainer enables; ``trl_says_use_reentrant``: what TRL wrote), each
step's loss, the error if training
raised (type, message; the exit status is then 1, as the script's would be), and with ``--runtime`` whether the
runtime was installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

from zerostate.clients.hf_job import HIDDEN, LAYERS, SEQ, VOCAB, _setup_env, ds_config

TRAINERS = ("sft", "grpo", "dpo")
WORDS = VOCAB - 4
"""Plain words of the tokenizer; the other ids are <pad>, <unk>, <bos>, <eos>."""


def tokenizer() -> Any:
    """A word-level tokenizer of ``VOCAB`` ids built in memory (``w0`` .. ``w123`` and four special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<bos>", "<eos>"] + [f"w{i}" for i in range(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>", model_max_length=2 * SEQ)


def llama() -> Any:
    """The tiny random-init Llama (`zerostate.clients.hf_job`'s size), without adapters: TRL adds them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                      max_position_embeddings=4 * SEQ, tie_word_embeddings=False, pad_token_id=0,
                      bos_token_id=2, eos_token_id=3)
    return LlamaForCausalLM(cfg)


def _sentence(i: int, n: int) -> str:
    return " ".join(f"w{(i * 7 + j * 3) % WORDS}" for j in range(n))


def dataset(trainer: str, rows: int) -> Any:
    from datasets import Dataset

    if trainer == "sft":
        return Dataset.from_dict({"text": [_sentence(i, SEQ - 2) for i in range(rows)]})
    if trainer == "grpo":
        return Dataset.from_dict({"prompt": [_sentence(i, 6) for i in range(rows)]})
    return Dataset.from_dict({"prompt": [_sentence(i, 6) for i in range(rows)],
                              "chosen": [" " + _sentence(i + 1, 4) for i in range(rows)],
                              "rejected": [" " + _sentence(i + 2, 4) for i in range(rows)]})


def _reward(completions: list[str], **_: Any) -> list[float | None]:
    """GRPO's reward: how many odd words were generated (any function of the text that varies serves: equal rewards
    give zero advantages and a zero loss)."""
    return [float(sum(1 for w in c.split() if w[1:].isdigit() and int(w[1:]) % 2)) for c in completions]


def _skip_shm_build() -> None:
    """One CPU rank: the shared-memory comm op has nothing to reduce; skip its JIT build (30-200 s), as hf_job does."""
    import os

    if os.environ.get("WORLD_SIZE", "1") != "1":
        return
    try:
        import deepspeed.comm.torch as ds_comm_torch
    except ImportError:
        return
    if hasattr(ds_comm_torch, "build_shm_op"):
        ds_comm_torch.build_shm_op = lambda: None


def config(trainer: str = "sft", ckpt: str = "trl", steps: int = 3, ds: str = "trainer") -> Any:
    """The job's ``<Trainer>Config`` as a TRL user writes it (``zerostate doctor`` reads its ``to_dict()``).
    ``reentrant`` / ``non_reentrant`` are written into ``gradient_checkpointing_kwargs`` here; `run` writes them
    again after the trainer is built (TRL may rewrite them)."""
    import tempfile

    import trl

    common: dict[str, Any] = {
        "output_dir": tempfile.mkdtemp(prefix=f"zerostate-trl-{trainer}-"), "max_steps": steps,
        "learning_rate": 1e-2, "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 1, "report_to": [],
        "save_strategy": "no", "seed": 0, "data_seed": 0, "dataloader_num_workers": 0, "disable_tqdm": True,
        "use_cpu": True, "gradient_checkpointing": ckpt != "none",
        "deepspeed": ds_config() if ds == "trainer" else None}
    if ckpt in ("reentrant", "non_reentrant"):
        common["gradient_checkpointing_kwargs"] = {"use_reentrant": ckpt == "reentrant"}
    if trainer == "sft":
        return trl.SFTConfig(per_device_train_batch_size=4, max_length=SEQ, **common)
    if trainer == "grpo":
        return trl.GRPOConfig(per_device_train_batch_size=2, num_generations=2, max_completion_length=6,
                              temperature=1.0, **common)
    return trl.DPOConfig(per_device_train_batch_size=2, max_length=SEQ, **common)


def run(trainer: str = "sft", ckpt: str = "trl", steps: int = 3, ds: str = "trainer", runtime: bool = False,
        callbacks: list | None = None) -> dict:
    """Train the job in this process; returns the result record (an error included, never raised).  ``callbacks``:
    HF ``TrainerCallback`` objects given to the trainer (benchmarks/bench_watch.py times and toggles the watch)."""
    import deepspeed
    import torch
    import trl
    from peft import LoraConfig

    _skip_shm_build()
    result: dict[str, Any] = {"trainer": trainer, "deepspeed": deepspeed.__version__, "trl": trl.__version__,
                              "torch": torch.__version__, "ckpt": ckpt, "runtime": runtime, "losses": []}
    if runtime:
        import zerostate.runtime as zr

        zr.patch_deepspeed()
    args = config(trainer, ckpt, steps, ds)
    peft = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model, tok, data = llama(), tokenizer(), dataset(trainer, 8 * steps)
    job: Any
    if trainer == "sft":
        job = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok, peft_config=peft,
                             callbacks=callbacks)
    elif trainer == "grpo":
        job = trl.GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                              processing_class=tok, peft_config=peft, callbacks=callbacks)
    else:
        job = trl.DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok, peft_config=peft,
                             callbacks=callbacks)
    # transformers 5.2x's Trainer enables checkpointing with ``activation_checkpointing_kwargs``; the old name is a
    # copy made in TrainingArguments.__post_init__, which TRL 1.16 rebinds when it "forces" use_reentrant=True
    if ckpt in ("reentrant", "non_reentrant"):  # after TRL's own choice, before train() enables checkpointing
        want = {"use_reentrant": ckpt == "reentrant"}
        job.args.gradient_checkpointing_kwargs = want
        if hasattr(job.args, "activation_checkpointing_kwargs"):
            job.args.activation_checkpointing_kwargs = dict(want)
    said = (job.args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
    used = getattr(job.args, "activation_checkpointing_kwargs", job.args.gradient_checkpointing_kwargs) or {}
    result["trl_says_use_reentrant"] = said if ckpt != "none" else None
    result["use_reentrant"] = used.get("use_reentrant") if ckpt != "none" else None  # None: the model's default
    try:
        out = job.train()
        result["train_loss"] = float(out.training_loss)
    except Exception as e:  # noqa: BLE001 - the job's outcome is data: stock 0.19.2 non-reentrant dies of seed 002
        result["error"] = {"type": type(e).__name__, "message": str(e)[:2000],
                           "traceback": traceback.format_exc()[-4000:]}
    result["losses"] = [row["loss"] for row in job.state.log_history if "loss" in row]
    if runtime:
        import zerostate.runtime as zr

        engine = getattr(job, "model_wrapped", None)
        result["installed"] = engine is not None and zr.installation(engine) is not None
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zerostate.clients.trl_job", description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", choices=TRAINERS, default="sft")
    ap.add_argument("--ckpt", choices=["trl", "reentrant", "non_reentrant", "none"], default="trl")
    ap.add_argument("--import-order", choices=["trl-first", "deepspeed-first"], default="trl-first")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ds-config", choices=["trainer", "launcher"], default="trainer",
                    help="trainer: <Trainer>Config(deepspeed=...); launcher: accelerate launch's DeepSpeed plugin")
    ap.add_argument("--runtime", action="store_true", help="zerostate.runtime.patch_deepspeed() first")
    ap.add_argument("--json", default=None, help="write the result here too")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    _setup_env("cpu")
    if a.import_order == "trl-first":
        import trl  # noqa: F401  (transformers, accelerate and peft with it; deepspeed not yet)
    else:
        import deepspeed  # noqa: F401
    result = run(a.trainer, a.ckpt, a.steps, a.ds_config, a.runtime)
    text = json.dumps(result)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            f.write(text)
    sys.stdout.write("\n" + text + "\n")
    return 1 if "error" in result else 0  # as the user's script would: training raised


if __name__ == "__main__":
    sys.exit(main())
