"""The run's size from the config: the model's parameters (the built-in Llama's by formula, any other route's
from its model built on the meta device: no memory, no weights read), train's save rule, and from them
``dry_run``'s estimate of the bytes each stage writes (each contract's ``writes_bytes``)."""

from __future__ import annotations

import dataclasses

from pipeline.config.schema import PipelineConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_STATES = 2
"""AdamW: exp_avg and exp_avg_sq, fp32 like the weights."""
RECORD_BYTES = 4096
"""About what one manifest, marker or record takes."""


class _VocabBound:
    """Stands in for the tokenizer before prepare-dirs made it: ``data.vocab_size`` tokens, its upper bound."""

    bos_token_id = eos_token_id = pad_token_id = None

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


_BUILT: dict[tuple[str, int], tuple[int, int]] = {}


def _built(cfg: PipelineConfig) -> tuple[int, int]:
    """(parameters, trainable parameters) of a non-built-in model, from its shapes on the meta device (vocab
    at ``data.vocab_size``, its upper bound, where the tokenizer decides it); (0, 0) when it cannot be built
    there (a factory that needs real tensors: unknown, an estimate only)."""
    from pipeline.workload.model import build_model  # noqa: PLC0415 - transformers only for these routes

    key = (repr(cfg.model), cfg.data.vocab_size)
    if key not in _BUILT:
        try:
            built = build_model(cfg.model, _VocabBound(cfg.data.vocab_size), meta=True)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - an estimate
            _BUILT[key] = (0, 0)
        else:
            params = list(built.parameters())  # shared (tied) parameters once
            _BUILT[key] = (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))
    return _BUILT[key]


def check_freeze(cfg: PipelineConfig) -> None:
    """``model.freeze``: each pattern matches a parameter of the model (checked at launch on the meta device, so a
    typo fails in one line before any job runs). A model that cannot be built there is left to train."""
    from pipeline.workload.model import build_model, freeze  # noqa: PLC0415 - transformers only when asked

    try:
        built = build_model(dataclasses.replace(cfg.model, freeze=[]), _VocabBound(cfg.data.vocab_size), meta=True)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - the model's own errors are train's to report
        return
    freeze(built, list(cfg.model.freeze))


def parameters(cfg: PipelineConfig) -> int:
    """Parameters of the model the config describes."""
    if cfg.model.route != "llama":
        return _built(cfg)[0]
    m, vocab = cfg.model, cfg.data.vocab_size
    head = m.hidden_size // m.num_heads
    attention = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * head * m.num_kv_heads
    layer = attention + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    return 2 * vocab * m.hidden_size + m.num_layers * layer + m.hidden_size  # embeddings and lm_head are untied


def checkpoint_bytes(cfg: PipelineConfig) -> int:
    """One checkpoint: fp32 weights and the optimizer's states (of the trainable parameters: LoRA's adapters)."""
    trainable = parameters(cfg) if cfg.model.route == "llama" and not cfg.model.freeze else _built(cfg)[1]
    return parameters(cfg) * 4 + trainable * 4 * OPTIMIZER_STATES


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
