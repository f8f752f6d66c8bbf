"""The real training jobs' set-up, without training (`clients.hf_job`, `clients.trl_job`): the DeepSpeed config a
user of DeepSpeed's defaults writes, the model as the user builds it, the TRL data and tokenizer.  The jobs are
trained under DeepSpeed by test_hf_trainer.py and the watch tests."""

from __future__ import annotations

import pytest

from zerostate.clients import hf_job, trl_job

pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_the_hf_jobs_config_is_zero3_at_deepspeeds_defaults():
    cfg = hf_job.ds_config()
    assert cfg["zero_optimization"] == {"stage": 3} and cfg["gradient_clipping"] == 1.0
    assert {cfg[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                             "train_batch_size")} == {"auto"}
    assert "bf16" not in cfg and hf_job.ds_config(dtype="bf16")["bf16"] == {"enabled": True}
    extra = hf_job._parse_zero(["stage3_max_reuse_distance=0", 'offload_param={"device": "cpu"}'])
    assert hf_job.ds_config(extra)["zero_optimization"] == {"stage": 3, "stage3_max_reuse_distance": 0,
                                                            "offload_param": {"device": "cpu"}}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        hf_job._parse_zero(["stage3_max_reuse_distance"])


@pytest.mark.parametrize("ckpt", ["none", "reentrant", "non_reentrant"])
def test_the_hf_jobs_model_trains_only_its_lora_adapters(ckpt):
    model = hf_job.build_model(ckpt)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), "LoRA freezes every base weight"
    llama = model.base_model.model  # transformers 5.x renamed the flag; the old name warns
    on = getattr(llama, "is_activation_checkpointing", None)
    assert (on if on is not None else llama.is_gradient_checkpointing) == (ckpt != "none")


def test_the_trl_jobs_tokenizer_and_data_use_only_its_own_words():
    tok = trl_job.tokenizer()
    assert len(tok) == hf_job.VOCAB and tok.pad_token == "<pad>"
    ids = tok("w0 w5 w123")["input_ids"]
    assert tok.decode(ids) == "w0 w5 w123" and tok.unk_token_id not in ids
    assert set(trl_job.dataset("sft", 3).column_names) == {"text"}
    assert set(trl_job.dataset("grpo", 3).column_names) == {"prompt"}
    dpo = trl_job.dataset("dpo", 3)
    assert set(dpo.column_names) == {"prompt", "chosen", "rejected"} and dpo[0]["chosen"] != dpo[0]["rejected"]
    assert trl_job._reward(["w1 w2 w3", "w2 w4"]) == [2.0, 0.0]  # odd words: a reward that varies
    assert trl_job.llama().config.vocab_size == hf_job.VOCAB
