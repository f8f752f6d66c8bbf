"""The second network family: a tiny Hugging Face ``LlamaForCausalLM`` (one decoder layer per block,
``tie_word_embeddings`` = ``tie``, HF's own gradient checkpointing, optional PEFT LoRA on ``q_proj`` /
``v_proj``), called as HF Trainer does: ``model(input_ids=..., labels=...)``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

from zerostate.model.scenario import Checkpoint, Scenario

VOCAB = 32
SEQ = 4


@runtime_checkable
class _ActivationCheckpointing(Protocol):
    """transformers >= 5.x's name for ``gradient_checkpointing_enable``."""

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict[str, bool]) -> None: ...


def build_llama(sc: Scenario) -> nn.Module:
    """A tiny HF Llama (hidden = width, 2 heads, one decoder layer per block), seeded; HF gradient
    checkpointing when the blocks ask for it; wrapped by PEFT LoRA when ``lora``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(sc.seed)
    w = sc.width
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=w, intermediate_size=2 * w, num_hidden_layers=len(sc.blocks),
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * SEQ,
                      tie_word_embeddings=sc.tie, attn_implementation="eager")  # type: ignore[call-arg]
    model = LlamaForCausalLM(cfg)
    ck = sc.blocks[0].checkpoint
    if ck is not Checkpoint.NONE:
        kw = {"use_reentrant": ck is Checkpoint.REENTRANT}
        if isinstance(model, _ActivationCheckpointing):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    out = apply_lora(sc, model)
    out.train()
    return out


def apply_lora(sc: Scenario, model: nn.Module) -> nn.Module:
    """PEFT LoRA on q/v projections when ``lora`` (``modules_to_save``: the head too); B drawn non-zero."""
    if not sc.lora:
        return model
    from peft import LoraConfig, get_peft_model
    save = ["lm_head"] if sc.modules_to_save else None  # DeepSpeed #8144
    wrapped: nn.Module = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                          target_modules=["q_proj", "v_proj"], modules_to_save=save))
    with torch.no_grad():  # LoRA's B starts at zero; non-zero makes A's gradient non-zero from step 0
        for n, p in wrapped.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    return wrapped


__all__ = ["SEQ", "VOCAB", "apply_lora", "build_llama"]
