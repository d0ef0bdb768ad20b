"""What every rank of a :class:`~pipeline.checkpoint.Checkpointer` agrees on before a save: the process group
(one made for a single process), the state's admission (:mod:`.admit`), and the metrics best-k ranks by."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from pipeline.checkpoint.save.admit import refusal
from pipeline.errors import PipelineError, StateError

log = logging.getLogger(__name__)


def ensure_process_group() -> bool:
    """True when this made the default process group: one process without ``torchrun`` gets a one-rank gloo
    group, in memory (no port, no file); several ranks must initialise theirs first."""
    if not dist.is_available():
        raise PipelineError("this torch build has no torch.distributed: the Checkpointer needs it (gloo)")
    if dist.is_initialized():
        return False
    world = os.environ.get("WORLD_SIZE")
    if world not in (None, "1"):
        raise PipelineError(
            f"WORLD_SIZE={world} but torch.distributed is not initialised: call dist.init_process_group() on every "
            "rank before constructing the Checkpointer"
        )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def end_process_group(made: bool) -> None:
    """End the default group :func:`ensure_process_group` made (a user's own group is theirs to end)."""
    if made and dist.is_initialized():
        dist.destroy_process_group()


def admit(step: int, sd: Mapping[str, Any], rank: int, any_rank: Any) -> None:
    """Refuse, on every rank alike, a save whose state a resume could not load (before anything is staged):
    this rank's first unloadable value, or that another rank's state has one."""
    why = refusal(sd)
    if any_rank(why is not None):
        if why is None:
            raise StateError(f"step {step} not saved: another rank's state holds a value a resume could not load")
        raise StateError(f"step {step} not saved: rank {rank}: {why}")


def reduce_metrics(
    recorded: dict[str, float | None], metric: str | None, group: Any, rank: int, step: int
) -> dict[str, float | None]:
    """Every rank's metrics, each the mean over the ranks that passed a finite value (``None`` where none did),
    with ``metric`` (best-k's) missing on every rank said in one WARNING line (rank 0). A collective."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, recorded, group=group)
    names = sorted({k for g in gathered for k in g})
    out: dict[str, float | None] = {}
    for name in names:
        values = [v for g in gathered if (v := g.get(name)) is not None and math.isfinite(v)]
        out[name] = sum(values) / len(values) if values else None
    if metric is not None and metric not in out and rank == 0:
        log.warning(
            "step %d saved without metrics[%r] (keep_best ranks by it): kept, never counted among the best; "
            "pass save(step, state, metrics={%r: value})",
            step,
            metric,
            metric,
        )
    return out
