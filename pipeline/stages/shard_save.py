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
(:mod:`pipeline.checkpoint.async_save`); the marker is still written here, last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pipeline.checkpoint.async_save import AsyncSaver, Progress
from pipeline.checkpoint.manifest import Marker, marker_path, write_marker
from pipeline.checkpoint.portable import TrainState, write_train_state
from pipeline.errors import VerificationError
from pipeline.formats.dcp import FORMAT, METADATA_FILE, RecordingWriter
from pipeline.orchestration.contract import StageContract, TaskContext
from pipeline.storage.atomic import clear_file
from pipeline.storage.faults import inject
from pipeline.storage.integrity import FileEntry, describe
from pipeline.strategies import zero

CONTRACT = StageContract(
    name="shard_save",
    needs=(),
    reads="live training state (inside train)",
    produces="checkpoints/staging/step_N/: rank-private DCP or DeepSpeed files + rank_K.done.json",
    marker="rank_<K>.done.json",
    distributed=True,
    launched=False,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """One rank's save of one step: ``ok`` once its marker is written; the bytes of its files and the time."""

    ok: bool
    bytes: int
    seconds: float
    error: str = ""
    """Why the save failed (first line of the error, its root cause for DCP's CheckpointException)."""


def save(ctx: TaskContext, step: int, state: dict[str, Any], process_group: Any) -> SaveResult:
    """Save ``state`` for ``step`` with DCP; ``ok`` is true when this rank's marker is written."""
    return _save(ctx, step, FORMAT, lambda staged: write_dcp(ctx, staged, state, process_group))


def save_async(ctx: TaskContext, saver: AsyncSaver, step: int, state: dict[str, Any], waited_s: float) -> float:
    """Stage ``state`` for ``step`` and persist it in the background, like :func:`save` (same files, same
    marker, written only once the files are fsync'd); returns how long training was blocked."""

    def persist(staged_state: dict[str, Any], group: Any, progress: Progress) -> int:
        staged = prepare(ctx, step)
        entries = write_dcp(ctx, staged, staged_state, group, progress.writer(staged))
        progress.written(len(entries))
        finish(ctx, staged, step, FORMAT, entries, before_marker=progress.before_marker)
        return sum(e.size for e in entries)

    return saver.start(step, state, persist, waited_s)


def write_dcp(
    ctx: TaskContext,
    staged: Path,
    state: dict[str, Any],
    process_group: Any,
    writer: RecordingWriter | None = None,
) -> tuple[FileEntry, ...]:
    """``dcp.save`` of ``state`` into ``staged`` (every file hashed while written and fsync'd on close): the
    entries of this rank's files for its marker. ``writer`` replaces the default :class:`RecordingWriter`
    (the async writer passes one that reports each file it opens)."""
    writer = writer or RecordingWriter(staged, threads=ctx.cfg.checkpoint.writer_threads_for(ctx.world_size))
    dcp.save(state, storage_writer=writer, process_group=process_group)
    # Data files were hashed while written; rank 0 (DCP's coordinator) also owns the small .metadata.
    return tuple(writer.written) + ((describe(staged, METADATA_FILE),) if ctx.rank == 0 else ())


def save_deepspeed(ctx: TaskContext, step: int, engine: Any, train: TrainState, fmt: str) -> SaveResult:
    """Save ``step`` through DeepSpeed (every rank calls it: DeepSpeed's save has its own barriers)."""

    def write(staged: Path) -> tuple[FileEntry, ...]:
        written = zero.save(engine, ctx.layout.staging, staged.name)
        return (*written, write_train_state(staged, ctx.rank, train))

    return _save(ctx, step, fmt, write)


def prepare(ctx: TaskContext, step: int) -> Path:
    """The step's staging dir, created if needed, without this rank's marker from an older attempt."""
    staged = ctx.layout.staged_step(step)
    staged.mkdir(parents=True, exist_ok=True)  # idempotent mkdir of a planned dir: safe from every rank
    clear_file(marker_path(staged, ctx.rank))  # our own stale marker from an older attempt, if any
    return staged


def finish(
    ctx: TaskContext,
    staged: Path,
    step: int,
    fmt: str,
    entries: tuple[FileEntry, ...],
    before_marker: Callable[[], None] = lambda: None,
) -> None:
    """Check the written files' sizes, then write this rank's done-marker (last, atomically): the one place a
    marker is written. ``before_marker`` may still refuse (raise), e.g. for a writer that was given up on."""
    for entry in entries:
        if (staged / entry.path).stat().st_size != entry.size:
            raise VerificationError(f"{staged / entry.path}: {entry.size} bytes hashed while writing, size differs")
    inject("shard_save.before_marker", rank=ctx.rank, step=step)
    before_marker()
    write_marker(
        staged,
        Marker(step=step, rank=ctx.rank, world_size=ctx.world_size, format=fmt, attempt=ctx.attempt, files=entries),
    )


def _save(ctx: TaskContext, step: int, fmt: str, write: Callable[[Path], tuple[FileEntry, ...]]) -> SaveResult:
    staged = prepare(ctx, step)
    t0 = time.monotonic()
    try:
        entries = write(staged)
        finish(ctx, staged, step, fmt, entries)
    except (Exception, CheckpointException) as e:  # dcp.save reports a rank's I/O error as a BaseException
        log.error(
            "SHARD SAVE FAILED: rank %d step %d into %s: %s — this step will not be committed%s",
            ctx.rank,
            step,
            staged,
            e,
            ""
            if ctx.cfg.checkpoint.fail_on_save_error
            else "; training continues (checkpoint.fail_on_save_error=false)",
        )
        if ctx.cfg.checkpoint.fail_on_save_error:
            raise
        return SaveResult(ok=False, bytes=0, seconds=time.monotonic() - t0, error=_first_cause(e))
    seconds = time.monotonic() - t0
    log.info("rank %d saved step %d (%d files) in %.2fs", ctx.rank, step, len(entries), seconds)
    return SaveResult(ok=True, bytes=sum(e.size for e in entries), seconds=seconds)


def _first_cause(e: BaseException) -> str:
    """One line: the deepest OSError in ``e``'s chain (or DCP's per-rank failures), else ``e`` itself."""
    seen: list[BaseException] = [e]
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: exception}
    if isinstance(failures, dict):
        seen += [f for f in failures.values() if isinstance(f, BaseException)]
    while seen[-1].__cause__ is not None or seen[-1].__context__ is not None:
        seen.append(seen[-1].__cause__ or seen[-1].__context__)  # type: ignore[arg-type]
        if len(seen) > 20:
            break
    chosen = next((x for x in seen if isinstance(x, OSError)), e)
    text = str(chosen).strip().splitlines()
    return f"{type(chosen).__name__}: {text[0] if text else ''}"[:300]
