"""The model: a small decoder-only Llama built from a ``transformers`` config (nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.config.schema import ModelConfig


def llama_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Same weights on every rank: initialisation is seeded by ``model.init_seed`` alone."""
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(cfg.init_seed)
        model = LlamaForCausalLM(llama_config(cfg, tokenizer))
    return model
