"""shard-save: every rank, called inside train at checkpoint steps.

Inputs: the live training state (model, optimizer, LR scheduler, step, data position, per-rank RNG).
Outputs: ``checkpoints/staging/step_N/`` in DCP format (DDP/FSDP2): rank K writes only its own
``__K_*.distcp`` files (rank 0 also DCP's ``.metadata``, as DCP's coordinator); or in DeepSpeed's own layout
(``strategy=deepspeed``): rank K's ``*zero_pp_rank_K_*`` files (ZeRO-1/2: rank 0 also
``mp_rank_00_model_states.pt``) written through a hashing checkpoint engine, and its
``train_state_rank_K.json``. Then ``rank_K.done.json`` lists them with sizes and xxh3-128 hashes, written last
and atomically.
Owner: each rank owns its own files and marker; nothing shared is renamed or deleted here.
Done-marker: ``rank_<K>.done.json``. A failed save is logged loudly and never becomes a committed step;
``checkpoint.fail_on_save_error=true`` makes it stop training instead. With ``checkpoint.async_save=true``
(:func:`save_async`) the same files and marker are written by a background thread from a staged copy
(:mod:`pipeline.checkpoint.save.async_save`); the marker is still written here, last. The per-rank save itself is
the library's (:mod:`pipeline.checkpoint.save.rank_save`); this module maps the stage's context onto it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.checkpoint.save import rank_save
from pipeline.checkpoint.save.async_save import AsyncSaver
from pipeline.checkpoint.save.portable import TrainState
from pipeline.checkpoint.save.rank_save import SaveResult
from pipeline.stagekit.contract import StageContract, TaskContext
from pipeline.stagekit.saving import deepspeed_files, target

CONTRACT = StageContract(
    name="shard_save",
    needs=(),
    reads="live training state (inside train)",
    produces="checkpoints/staging/step_N/: rank-private DCP or DeepSpeed files + rank_K.done.json",
    marker="rank_<K>.done.json",
    distributed=True,
    launched=False,
)

__all__ = ["CONTRACT", "SaveResult", "deepspeed_files", "save", "save_async", "save_deepspeed", "target"]


def save(
    ctx: TaskContext, step: int, state: dict[str, Any], process_group: Any, groups: Mapping[str, str] | None = None
) -> SaveResult:
    """Save ``state`` for ``step`` with DCP; ``ok`` is true when this rank's marker is written. ``groups``: the
    FQNs saved as shared pieces (``checkpoint.dedup``; :mod:`pipeline.checkpoint.save.pieces`)."""
    return rank_save.save_dcp(target(ctx), step, state, process_group, groups)


def save_async(
    ctx: TaskContext,
    saver: AsyncSaver,
    step: int,
    state: dict[str, Any],
    waited_s: float,
    groups: Mapping[str, str] | None = None,
) -> float:
    """Stage ``state`` for ``step`` and persist it in the background, like :func:`save` (same files, same
    marker, written only once the files are fsync'd); returns how long training was blocked."""
    return saver.start(step, state, rank_save.dcp_persist(target(ctx), step, groups), waited_s)


def save_deepspeed(ctx: TaskContext, step: int, engine: Any, train: TrainState, fmt: str) -> SaveResult:
    """Save ``step`` through DeepSpeed (every rank calls it: DeepSpeed's save has its own barriers); train saves
    through its session, with :func:`deepspeed_files`."""
    return rank_save.save_files(target(ctx), step, fmt, deepspeed_files(ctx.rank, engine, train))
