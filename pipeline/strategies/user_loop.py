"""``train.loop._target_``: your whole training loop, called in every rank with the pieces train built; and the
eval loss both loops compute.

Contract (``examples/mypkg/train.py`` is one): ``fn(ctx: LoopContext, **train.loop.args) -> int`` trains the steps
``ctx.start_step + 1 .. ctx.last_step`` and returns the last step it trained. After each step it calls
``ctx.step_done(step, loss, tokens)``, which does what the built-in loop does after a step, identically: the
LR schedule's step, the step's metrics (loss over every rank, lr, tokens/s), the eval loss, the checkpoint at
save steps (sync or async, every rank's state: model, optimizer, schedule, data position, RNG) and the
preemption check; when it returns True the loop must return ``step`` (the run stops there and resumes later).
The data comes from ``ctx.data.next_batch(step)`` so that its position is saved and restored exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError
from pipeline.strategies.trainer import Trainer
from pipeline.workload.data import SampleStream
from pipeline.workload.model import load_target


@dataclass
class LoopContext:
    cfg: PipelineConfig
    trainer: Trainer
    """``trainer.net`` (the wrapped model: DDP, FSDP2 or the DeepSpeed engine), ``trainer.module``,
    ``trainer.opt``; ``trainer.train_step(batch)`` runs the configured step (accumulation, clipping, bf16)."""
    data: SampleStream
    device: torch.device
    rank: int
    world_size: int
    start_step: int
    """The step this launch resumed from (0: a fresh start)."""
    last_step: int
    step_done: Callable[[int, torch.Tensor, int], bool]
    """``step_done(step, loss, tokens)``: after each step (``tokens``: this rank's tokens in the step); True: stop."""
    scheduler: Any = field(default=None)


def run_user_loop(ctx: LoopContext) -> int:
    hook = ctx.cfg.train.loop
    fn = load_target(str(hook._target_), "train.loop._target_")
    last = fn(ctx, **hook.args)
    if not isinstance(last, int) or not ctx.start_step <= last <= ctx.last_step:
        raise PipelineError(
            f"train.loop._target_={hook._target_} returned {last!r}: return the last step it trained "
            f"(between {ctx.start_step} and {ctx.last_step})"
        )
    return last


def eval_loss(trainer: Trainer, batches: list[torch.Tensor], device: torch.device, group: Any) -> tuple[float, int]:
    """The mean loss over every rank's held-out ``batches`` (one all_reduce) and how many samples that is."""
    trainer.net.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            total += torch.tensor([float(trainer.loss(batch.to(device))) * len(batch), len(batch)])
    trainer.net.train()
    dist.all_reduce(total, group=group)
    return (float(total[0] / total[1]) if total[1] else float("nan")), int(total[1])
