"""The resumable, rank-aware sample order over the run's tokens (:mod:`pipeline.workload.corpus` makes them).

A sample is ``data.seq_len`` consecutive tokens of one token file (or of the tokenized corpus); samples are
numbered in file order. The last ``data.eval_samples`` of them are held out for evaluation. The data position is
``(epoch, offset)`` into a per-epoch permutation of the training samples seeded by ``train.seed + epoch``; each
step takes the next global batch and rank ``k`` its ``k``-th slice. The position is global (the same number at
any world size for the same global batch), and it is saved in every checkpoint: a resumed run, at any world
size, sees exactly the samples an uninterrupted run would, none skipped or repeated.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from pipeline.errors import ConfigError
from pipeline.storage.atomic import read_json
from pipeline.workload.corpus import DATA_FILE, TOKENS_FILE, data_source, load_tokenizer

__all__ = ["DataPosition", "SampleStream", "load_tokenizer"]

SAMPLES_ENV = "PIPELINE_SAMPLES_FILE"
"""Tests set it to a path: each rank appends the sample indices it trains on to ``<path>.rank<K>`` (JSON lines)."""


@dataclass
class DataPosition:
    epoch: int = 0
    offset: int = 0


class TokenSamples:
    """Fixed-length samples over one or more flat token arrays (in memory, or memory-mapped files)."""

    def __init__(self, arrays: list[np.ndarray | torch.Tensor], seq_len: int) -> None:
        self.arrays, self.seq_len = arrays, seq_len
        counts = [len(a) // seq_len for a in arrays]
        self.starts = np.cumsum([0, *counts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, index: int) -> torch.Tensor:
        f = int(np.searchsorted(self.starts, index, side="right")) - 1
        off = (index - int(self.starts[f])) * self.seq_len
        chunk = self.arrays[f][off : off + self.seq_len]
        return chunk.to(torch.int64) if isinstance(chunk, torch.Tensor) else torch.from_numpy(chunk.astype(np.int64))

    def batch(self, indices: list[int]) -> torch.Tensor:
        return torch.stack([self.get(i) for i in indices])


def open_samples(assets: Path, seq_len: int) -> TokenSamples:
    """The run's samples: its tokenized corpus, or its token files (memory-mapped in place)."""
    if data_source(assets) == "tokens":
        meta = read_json(assets / DATA_FILE)  # one read: the dtype and the fingerprinted files
        dtype = np.dtype(meta.get("dtype", "uint16"))
        arrays: list[np.ndarray | torch.Tensor] = [
            np.memmap(rec["path"], dtype=dtype, mode="r") for rec in meta.get("files", [])
        ]
        return TokenSamples(arrays, seq_len)
    return TokenSamples([load_file(str(assets / TOKENS_FILE))["tokens"]], seq_len)


class SampleStream:
    """Step batches: slices of a seeded permutation of the training samples, split by rank."""

    def __init__(
        self,
        assets: Path,
        seq_len: int,
        seed: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        eval_samples: int = 0,
    ):
        self.data = open_samples(assets, seq_len)
        n = len(self.data) - eval_samples
        self.n_train, self.eval_samples = n, eval_samples
        self.seed = seed
        self.mbs = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.pos = DataPosition()
        self.last_indices: list[int] = []
        self._perm_cache: tuple[int, torch.Tensor] | None = None
        self._log = f"{os.environ[SAMPLES_ENV]}.rank{rank}" if os.environ.get(SAMPLES_ENV) else None
        if n < micro_batch_size * world_size:
            raise ConfigError(
                f"the data gives only {n} training samples of data.seq_len={seq_len} tokens (after "
                f"data.eval_samples={eval_samples}), fewer than one global batch ({micro_batch_size * world_size}): "
                "add data (data.num_documents, data.path) or lower data.seq_len / the batch size"
            )

    def _perm(self, epoch: int) -> torch.Tensor:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm_cache = (epoch, torch.randperm(self.n_train, generator=gen))
        return self._perm_cache[1]

    def next_batch(self, step: int = 0) -> torch.Tensor:
        global_bs = self.mbs * self.world_size
        if self.pos.offset + global_bs > self.n_train:
            self.pos = DataPosition(self.pos.epoch + 1, 0)
        idx = self._perm(self.pos.epoch)[self.pos.offset : self.pos.offset + global_bs]
        self.pos = DataPosition(self.pos.epoch, self.pos.offset + global_bs)
        mine = [int(i) for i in idx[self.rank * self.mbs : (self.rank + 1) * self.mbs]]
        if self._log is not None:
            with open(self._log, "a") as f:
                f.write(json.dumps({"step": step, "epoch": self.pos.epoch, "indices": mine}) + "\n")
        return self.data.batch(mine)

    def eval_batches(self, batch_size: int) -> list[torch.Tensor]:
        """This rank's share of the held-out samples (rank ``k`` takes every ``world_size``-th), in batches; every
        rank gets as many batches (a sharded model's forward is a collective), so a remainder is left out."""
        usable = self.eval_samples // self.world_size * self.world_size
        mine = list(range(self.n_train + self.rank, self.n_train + usable, self.world_size))
        return [self.data.batch(mine[i : i + batch_size]) for i in range(0, len(mine), batch_size)]

    def first_sample(self) -> torch.Tensor:
        return self.data.get(0)
