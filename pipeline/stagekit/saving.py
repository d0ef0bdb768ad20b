"""A stage task as the library's save target: what train saves through its session and shard-save's functions
use alike (so train imports no other stage)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pipeline.stagekit.checkpoint_store as storage
from pipeline.checkpoint.save import deepspeed_engine
from pipeline.checkpoint.save.portable import TrainState, write_train_state
from pipeline.checkpoint.save.rank_save import RankTarget
from pipeline.stagekit.contract import TaskContext
from pipeline.storage.integrity import FileEntry


def target(ctx: TaskContext) -> RankTarget:
    """This task as the library's save target."""
    ck = ctx.cfg.checkpoint
    return RankTarget(
        layout=ctx.layout,
        rank=ctx.rank,
        world_size=ctx.world_size,
        attempt=ctx.attempt,
        writer_threads=ck.writer_threads_for(ctx.world_size),
        fail_on_error=ck.fail_on_save_error,
        remote=storage.remote(ctx.cfg, ctx.layout),
        dedup=ck.dedup,
    )


def deepspeed_files(rank: int, engine: Any, train: TrainState) -> Callable[[Path], tuple[FileEntry, ...]]:
    """What a rank writes of a DeepSpeed step (the library's DeepSpeed adapter, then this rank's training state
    as JSON beside it), for :meth:`~pipeline.checkpoint.save.session.CheckpointSession.save_files`."""

    def write(staged: Path) -> tuple[FileEntry, ...]:
        written = deepspeed_engine.save(engine, staged.parent, staged.name)  # staging/, or the upload scratch
        return (*written, write_train_state(staged, rank, train))

    return write
