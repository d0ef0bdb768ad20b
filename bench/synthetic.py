"""Shared by the benchmarks: the parameter layout of an LLM-shaped synthetic checkpoint."""

from __future__ import annotations

import math
from typing import Any

VOCAB = 8192


def model_layout(
    size_mb: float, base_dim: int, ref_size_mb: float, dim: int = 0
) -> tuple[int, list[tuple[str, tuple[int, ...]]]]:
    """(hidden size, [(param name, full shape)]) for a checkpoint of about ``size_mb`` MB (fp32; model = 1/3,
    AdamW exp_avg + exp_avg_sq the other 2/3).

    The hidden size is ``base_dim`` at ``ref_size_mb`` and scales with sqrt(size), so the largest tensor
    (embedding / lm_head) scales with the size, unless ``dim`` fixes it (then only the layer count follows).
    """
    dim = dim or max(64, round(base_dim * math.sqrt(size_mb / ref_size_mb) / 64) * 64)
    embed = VOCAB * dim * 4
    layer = (12 * dim * dim + 2 * dim) * 4
    n_layers = max(1, round((size_mb * 1e6 / 3 - 2 * embed) / layer))
    names: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (VOCAB, dim))]
    for i in range(n_layers):
        p = f"layers.{i}."
        names += [
            (p + "input_norm.weight", (dim,)),
            (p + "attn.qkv.weight", (3 * dim, dim)),
            (p + "attn.o.weight", (dim, dim)),
            (p + "post_norm.weight", (dim,)),
            (p + "mlp.up.weight", (4 * dim, dim)),
            (p + "mlp.down.weight", (dim, 4 * dim)),
        ]
    names += [("norm.weight", (dim,)), ("lm_head.weight", (VOCAB, dim))]
    return dim, names


def training_state(model: dict[str, Any], optim_state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Wrap model and optimizer tensors in the pipeline's checkpoint shape (``pipeline/stages/train.py:_state``)."""
    import torch

    return {
        "model": model,
        "optim": {"state": optim_state, "param_groups": [{"lr": 1e-3, "params": list(model)}]},
        "sched": {"last_epoch": 7, "base_lrs": [1e-3]},
        "train": {"step": torch.tensor(7), "data_epoch": torch.tensor(0), "data_offset": torch.tensor(448)},
        "rng": {f"rank_{rank}": torch.get_rng_state()},
    }
