"""The app's train stage with the library's fast tier (``checkpoint.fast.*``): open it, restore from it, record
how a launch resumed. The protocol is the library's (:mod:`pipeline.checkpoint.fast`); this is only wiring."""

from __future__ import annotations

from typing import Any

import pipeline.stagekit.checkpoint_store as storage
from pipeline.checkpoint.fast.landing import Landing
from pipeline.checkpoint.fast.resuming import FastResume
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


def resume_with(ctx: TaskContext, tier: FastTier | None, landing: Landing) -> FastResume | None:
    """The fast restore of this task (None without a fast tier)."""
    if tier is None:
        return None
    return FastResume(tier, storage.store(ctx.cfg, ctx.layout), ctx.layout.checkpoints, landing)
