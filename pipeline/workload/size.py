"""The run's size from the config alone (nothing is built or read): the model's parameters, train's save rule,
and from them ``dry_run``'s estimate of the bytes each stage writes (each contract's ``writes_bytes``)."""

from __future__ import annotations

from pipeline.config.schema import PipelineConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_STATES = 2
"""AdamW: exp_avg and exp_avg_sq, fp32 like the weights."""
RECORD_BYTES = 4096
"""About what one manifest, marker or record takes."""


def parameters(cfg: PipelineConfig) -> int:
    """Parameters of the Llama the config describes (vocab taken at ``data.vocab_size``, its upper bound)."""
    m, vocab = cfg.model, cfg.data.vocab_size
    head = m.hidden_size // m.num_heads
    attention = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * head * m.num_kv_heads
    layer = attention + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    return 2 * vocab * m.hidden_size + m.num_layers * layer + m.hidden_size  # embeddings and lm_head are untied


def checkpoint_bytes(cfg: PipelineConfig) -> int:
    """One checkpoint: fp32 weights and the optimizer's states."""
    return parameters(cfg) * 4 * (1 + OPTIMIZER_STATES)


def final_step(cfg: PipelineConfig) -> int:
    """The last step this launch trains: ``train.steps``, or ``train.stop_after_step`` when earlier."""
    stop = cfg.train.stop_after_step
    return cfg.train.steps if stop is None else min(stop, cfg.train.steps)


def is_save_step(cfg: PipelineConfig, step: int) -> bool:
    """Train's save rule: every ``checkpoint.every`` steps, and the last step."""
    return step % cfg.checkpoint.every == 0 or step == cfg.train.steps or step == final_step(cfg)


def save_count(cfg: PipelineConfig) -> int:
    """Checkpoints a whole run stages (the save rule counted, not written again)."""
    every, steps = cfg.checkpoint.every, cfg.train.steps
    return steps // every + (0 if steps % every == 0 else 1)
