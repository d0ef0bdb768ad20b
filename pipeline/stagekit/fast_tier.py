"""The app's train stage with the library's fast tier (``checkpoint.fast.*``): open it, restore from it, record
how a launch resumed. The protocol is the library's (:mod:`pipeline.checkpoint.fast`); this is only wiring."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pipeline.stagekit.checkpoint_store as storage
from pipeline.checkpoint.fast.restore import restore
from pipeline.checkpoint.fast.resuming import durable_floor, record_resume
from pipeline.checkpoint.fast.tier import FastConfig, FastTier
from pipeline.stagekit.contract import TaskContext


def open_tier(ctx: TaskContext, group: Any, deepspeed: bool) -> FastTier | None:
    """Every rank: the fast tier ``checkpoint.fast`` asks for (None: off, or a DeepSpeed run, whose engine
    writes its own layout)."""
    fast = ctx.cfg.checkpoint.fast
    if fast.every is None or deepspeed:
        return None
    cfg = FastConfig(every=fast.every, dir=fast.dir, replicas=fast.replicas, keep=fast.keep)
    return FastTier(cfg, ctx.layout.run_dir, ctx.attempt, group, ctx.cfg.checkpoint.async_deadline_s)


class FastResume:
    """The ``first``/``floor`` pair :meth:`CheckpointSession.load_latest` takes, and the record rank 0 writes."""

    def __init__(self, ctx: TaskContext, tier: FastTier, load: Callable[[bytes], int]) -> None:
        self.ctx, self.tier, self.load = ctx, tier, load
        self.rec: dict[str, Any] | None = None

    def floor(self) -> int:
        return durable_floor(storage.store(self.ctx.cfg, self.ctx.layout), self.ctx.world_size)

    def first(self, floor: int) -> int | None:
        return restore(self.tier, floor, self.load, self._note)

    def _note(self, rec: dict[str, Any]) -> None:
        self.rec = rec

    def record(self, step: int) -> None:
        """Rank 0, once the step is loaded: ``checkpoints/resumed.json``."""
        record_resume(self.ctx.layout.checkpoints, self.rec, step, self.ctx.attempt, self.tier.cfg)
