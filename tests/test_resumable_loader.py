"""``ResumableLoader``: a plain ``DataLoader`` resumed exactly, through a real save and load.

* Shuffled by its own generator (one rank): a run saved after 5 batches of epoch 1 and resumed in fresh objects
  (as after a kill) takes the same batches as the uninterrupted run, the rest of epoch 1 and all of epoch 2
  (the generator's later draws included); with 2 workers as well.
* Under ``DistributedSampler``, saved at 2 ranks after 3 batches, resumed at 3 ranks: the samples the new ranks
  take complete the epoch (each sample once, besides ``DistributedSampler``-style padding), each new rank takes
  as many batches, and the next epoch is ``DistributedSampler``'s own at 3 ranks. Resumed at 2 ranks: the same
  batches as the uninterrupted run.
* A loader that shuffles with torch's global generator is refused in one line saying what to pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from pipeline.checkpoint import Checkpointer, RankLocal
from pipeline.checkpoint.loader import ResumableLoader
from pipeline.errors import PipelineError

DATA = list(range(50))


def _shuffled(workers: int = 0) -> DataLoader[int]:
    return DataLoader(DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7), num_workers=workers)


def _take(data: ResumableLoader, n: int | None) -> list[list[int]]:
    out = []
    for batch in data:
        out.append(batch.tolist())
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shuffled_loader_resumes_mid_epoch_exactly_through_a_save_and_load(
    tmp_path: Path, one_rank: Any, workers: int
) -> None:
    whole = ResumableLoader(_shuffled(workers))
    uninterrupted = _take(whole, None) + _take(whole, None) + _take(whole, None)

    first = ResumableLoader(_shuffled(workers))
    seen = _take(first, None) + _take(first, 5)  # epoch 0, then 5 batches of epoch 1: the job dies here
    with Checkpointer(tmp_path, poll_interval_s=0.05) as ck:
        assert ck.save(18, {"data": RankLocal(first, 0)}).ok

    again = ResumableLoader(_shuffled(workers))  # a new process: fresh objects, the same code
    with Checkpointer(tmp_path, poll_interval_s=0.05) as ck:
        assert ck.load_latest({"data": RankLocal(again, 0)}) == 18
    assert again.epoch == 1
    seen += _take(again, None) + _take(again, None)
    assert seen == uninterrupted


def _distributed(world: int, rank: int) -> ResumableLoader:
    return ResumableLoader(DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, world, rank, seed=3)))


def test_a_distributed_loader_resumes_at_another_world_size_with_the_samples_not_yet_taken() -> None:
    old = [_distributed(2, r) for r in range(2)]
    before = [_take(d, 3) for d in old]
    saved = [d.state_dict() for d in old]
    assert saved[0] == saved[1], "the position is the same on every rank: it needs no RankLocal"

    same = [_distributed(2, r) for r in range(2)]
    for d in same:
        d.load_state_dict(saved[0])
    whole = [_take(_distributed(2, r), None) for r in range(2)]
    assert [b + _take(d, None) for b, d in zip(before, same, strict=True)] == whole

    new = [_distributed(3, r) for r in range(3)]
    for d in new:
        d.load_state_dict(saved[0])
    after = [_take(d, None) for d in new]
    assert len({len(a) for a in after}) == 1, "every new rank takes as many batches"
    taken = [i for rank in before + after for batch in rank for i in batch]
    assert set(taken) == set(DATA) and len(taken) - len(DATA) < 3 * 4, "each sample once, besides the padding"
    nxt = [_take(d, None) for d in new]
    for r in range(3):
        sampler = DistributedSampler(DATA, 3, r, seed=3)
        sampler.set_epoch(1)
        order = list(sampler)
        assert [i for batch in nxt[r] for i in batch] == order


def test_a_loader_shuffled_by_the_global_generator_is_refused_in_one_line() -> None:
    with pytest.raises(PipelineError, match=r"generator=torch\.Generator\(\)\.manual_seed\(seed\)\)$"):
        ResumableLoader(DataLoader(DATA, batch_size=4, shuffle=True))
