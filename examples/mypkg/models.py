"""A model that is not a ``transformers`` model: the contract the pipeline expects of a user module.

* ``forward(input_ids, labels=None)``: the loss when ``labels`` is given, else the logits;
* ``fsdp_units()``: the submodules FSDP2 shards as units (here: the blocks);
* its weights are exported as safetensors with a ``config.json`` naming this factory and its arguments.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    """An MLP language model over a causal running mean of token embeddings."""

    def __init__(self, vocab_size: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, device=h.device).view(1, -1, 1)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build(vocab_size: int = 320, dim: int = 32, layers: int = 2) -> TinyLM:
    return TinyLM(vocab_size, dim, layers)
