"""``ResumableLoader``: the plain ``torch.utils.data.DataLoader`` a script already has, resumed exactly.

    data = ResumableLoader(DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds, seed=0)))
    state = {"model": model, "optim": opt, "data": RankLocal(data, rank), "rng": RankRNG(rank)}
    for batch in data:          # one epoch per ``for``; data.epoch counts them
        ...

Its state is the epoch, the batches this rank took in it, the world size and batch size, and the state its
generator (the loader's ``generator=``, or its ``RandomSampler``'s) had when the epoch began. A resume at the same
world size restores that generator state, starts the epoch again and skips the batches taken by index (without
loading them, in a loader with no workers; with workers the skipped batches are loaded and dropped), so every
random draw of the loader, this epoch and the next ones, is the uninterrupted run's. Under a ``DistributedSampler``
a resume at another world size continues the epoch with the samples no rank has taken yet, shared out among the
new ranks as ``DistributedSampler`` shares an epoch (padded so each rank takes as many); its later epochs are
``DistributedSampler``'s own. A ``RandomSampler`` without a generator of its own draws its order from torch's
global generator, which a resume cannot rebuild: refused at construction, in one line saying what to pass.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)

_CLONED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
           "generator", "prefetch_factor", "persistent_workers")  # fmt: skip


class ResumableLoader:
    """Iterate ``loader`` through this (one epoch per ``for``); save it in the state under ``RankLocal``."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        if not isinstance(loader, DataLoader):
            raise PipelineError(f"ResumableLoader takes a torch DataLoader, not a {type(loader).__name__}")
        sampler = loader.sampler
        if not isinstance(sampler, DistributedSampler | RandomSampler | SequentialSampler):
            raise PipelineError(
                f"ResumableLoader: a {type(sampler).__name__} cannot be rebuilt on resume; use DistributedSampler, "
                "RandomSampler (with generator=) or no shuffle, or torchdata's StatefulDataLoader"
            )
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            raise PipelineError(
                "ResumableLoader: this loader shuffles with torch's global generator, which a resume cannot rebuild: "
                "pass DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(seed))"
            )
        if loader.batch_size is None:
            raise PipelineError("ResumableLoader: the loader must batch (batch_size=N)")
        self.loader = loader
        self.epoch = 0
        self.taken = 0
        """Batches this rank took in the current epoch."""
        self._start: torch.Tensor | None = None
        self._resume: dict[str, Any] | None = None

    # -- iteration ------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        sampler = self.loader.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(self.epoch)
        resume, self._resume = self._resume, None
        generator = self._generator()
        if resume is not None and resume["gen"] is not None and generator is not None:
            generator.set_state(resume["gen"])
        self._start = generator.get_state() if generator is not None else None
        if resume is not None and resume["world"] != _world(sampler):
            source: Any = iter(self._rest_of_epoch(resume))
            self.taken = 0
        else:
            source = iter(self.loader)
            self.taken = self._skip(source, resume["taken"]) if resume is not None else 0
        for batch in source:
            self.taken += 1
            yield batch
        self.epoch += 1
        self.taken = 0

    def __len__(self) -> int:
        return len(self.loader)

    def _generator(self) -> torch.Generator | None:
        sampler = self.loader.sampler
        if isinstance(sampler, RandomSampler) and sampler.generator is not None:
            return sampler.generator  # DataLoader(shuffle=True, generator=g) hands g to it
        return self.loader.generator

    def _skip(self, it: Any, taken: int) -> int:
        """Skip ``taken`` batches of ``it``: by index where no worker has been handed any yet, else fetched."""
        fast = self.loader.num_workers == 0 and hasattr(it, "_sampler_iter")
        for _ in range(taken):
            if fast:
                next(it._sampler_iter)
            else:
                next(it)
        return taken

    def _rest_of_epoch(self, resume: dict[str, Any]) -> DataLoader[Any]:
        """A loader over this rank's share of the samples no rank took yet (a resume at another world size)."""
        sampler = self.loader.sampler
        if not isinstance(sampler, DistributedSampler):  # the world size differs only for one
            raise PipelineError(f"ResumableLoader: saved at world size {resume['world']}, resumed without one")
        order = _epoch_order(sampler, self.epoch)
        rest = order[min(len(order), resume["taken"] * resume["batch"] * resume["world"]) :]
        world, rank = sampler.num_replicas, sampler.rank
        share = math.ceil(len(rest) / world) if rest else 0
        padded = (rest * math.ceil(share * world / len(rest)))[: share * world] if rest else []
        mine = padded[rank::world]
        log.info("rank %d: epoch %d resumed at world size %d (saved at %d): %d of its samples left",
                 rank, self.epoch, world, resume["world"], len(mine))  # fmt: skip
        kwargs = {k: getattr(self.loader, k) for k in _CLONED}
        if kwargs["num_workers"] == 0:
            kwargs.pop("prefetch_factor")
            kwargs["persistent_workers"] = False
        return DataLoader(self.loader.dataset, batch_size=self.loader.batch_size, sampler=mine,
                          drop_last=self.loader.drop_last, **kwargs)  # fmt: skip

    # -- state ---------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "taken": self.taken,
            "world": _world(self.loader.sampler),
            "batch": self.loader.batch_size,
            "gen": self._start if self._start is not None else None,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume at the saved epoch and position: the next ``for`` continues where the saved run was."""
        self.epoch = int(sd["epoch"])
        self.taken = 0
        self._resume = {"taken": int(sd["taken"]), "world": int(sd["world"]), "batch": int(sd["batch"]),
                        "gen": sd.get("gen")}  # fmt: skip


def _world(sampler: Any) -> int:
    return sampler.num_replicas if isinstance(sampler, DistributedSampler) else 1


def _epoch_order(sampler: DistributedSampler[Any], epoch: int) -> list[int]:
    """Every rank's samples of ``epoch`` in the order ``DistributedSampler`` deals them (rank ``r`` takes
    positions ``r, r + W, ...``), unpadded: what ``DistributedSampler.__iter__`` computes before it shares out."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.shuffle:
        g = torch.Generator()
        g.manual_seed(sampler.seed + epoch)
        return list(torch.randperm(n, generator=g).tolist())
    return list(range(n))
