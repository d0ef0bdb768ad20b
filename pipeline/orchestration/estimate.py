"""Rough bytes each stage writes, for ``dry_run=true`` (from the config alone: nothing is built or read)."""

from __future__ import annotations

from pipeline.config.schema import PipelineConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_OPTIMIZER_STATES = 2  # AdamW: exp_avg and exp_avg_sq, fp32 like the weights


def parameters(cfg: PipelineConfig) -> int:
    """Parameters of the Llama the config describes (vocab taken at ``data.vocab_size``, its upper bound)."""
    m, vocab = cfg.model, cfg.data.vocab_size
    head = m.hidden_size // m.num_heads
    attention = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * head * m.num_kv_heads
    layer = attention + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    return 2 * vocab * m.hidden_size + m.num_layers * layer + m.hidden_size  # embeddings and lm_head are untied


def save_steps(cfg: PipelineConfig) -> int:
    every = cfg.checkpoint.every
    steps = cfg.train.steps
    return steps // every + (0 if steps % every == 0 else 1)


def bytes_written(stage: str, cfg: PipelineConfig) -> int:
    """Approximate bytes ``stage`` writes for the whole run (train: every checkpoint it stages)."""
    params = parameters(cfg)
    if stage == "train":
        return save_steps(cfg) * params * 4 * (1 + _OPTIMIZER_STATES)
    if stage == "consolidate":
        return params * 4
    if stage == "export":
        return params * _DTYPE_BYTES.get(cfg.export.dtype, 4)
    if stage == "prepare_dirs":
        return cfg.data.num_documents * cfg.data.seq_len * 8  # corpus, tokens and the tokenizer: small
    return 4096 * (1 + save_steps(cfg))  # manifests, latest, records
