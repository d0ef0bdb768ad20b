"""A user's own training step and loop, as ``train.step._target_`` and ``train.loop._target_`` call them."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F


def loss(model: Any, batch: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """``train.step._target_=mypkg.train.loss``: next-token cross entropy (optionally label-smoothed), computed
    here from the model's logits instead of by the model."""
    out = model(input_ids=batch)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1), label_smoothing=label_smoothing
    )


def loop(ctx: Any, log_every: int = 0) -> int:
    """``train.loop._target_=mypkg.train.loop``: the whole loop. Batches come from ``ctx.data`` (so the data
    position is checkpointed), ``ctx.step_done`` does the schedule, metrics, eval, checkpoints and preemption."""
    for step in range(ctx.start_step + 1, ctx.last_step + 1):
        batch = ctx.data.next_batch(step).to(ctx.device)
        loss_value = ctx.trainer.train_step(batch)
        if log_every and step % log_every == 0 and ctx.rank == 0:
            print(f"my loop: step {step} loss {float(loss_value):.4f}", flush=True)
        if ctx.step_done(step, loss_value, batch.numel()):
            return step
    return int(ctx.last_step)
