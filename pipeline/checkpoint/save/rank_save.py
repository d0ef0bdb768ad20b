"""One rank's save of one step: its rank-private files, then its done-marker, written last and atomically.

Inputs: the rank's state (a DCP state dict, or files a strategy writes itself) and a :class:`RankTarget`
(checkpoint dir, rank, world size, the attempt every rank of this launch shares, writer threads).
Outputs: ``checkpoints/staging/step_N/``: this rank's files (``__K_*.distcp``; rank 0 also DCP's ``.metadata``,
as DCP's coordinator), then ``rank_K.done.json`` listing them with sizes and xxh3-128 hashes.
Owner: each rank owns its own files and marker; nothing shared is renamed or deleted here. With shared groups,
frozen parameters and buffers go to pieces of their own (``__K_frozen<n>.distcp``, ``__K_buffers<n>.distcp``); an
unchanged piece is a hard link to the earlier step's file (in a bucket: not uploaded again), never a write
through an existing name (:mod:`pipeline.checkpoint.save.pieces`).

Used by the library's :class:`~pipeline.checkpoint.Checkpointer` and by the app's shard-save stage alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pipeline.checkpoint.manifest import Marker, Metrics
from pipeline.checkpoint.save.async_save import Persist, Progress, Settled
from pipeline.checkpoint.stores.remote import Remote
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.checkpoint.stores.stores import store_for
from pipeline.errors import PipelineError, VerificationError, exception_line
from pipeline.formats.dcp import FORMAT, METADATA_FILE, RecordingWriter
from pipeline.storage.faults import inject
from pipeline.storage.integrity import FileEntry, describe
from pipeline.storage.layout import CheckpointLayout, step_name
from pipeline.storage.writers import auto_writer_threads

__all__ = ["RankTarget", "SaveResult", "auto_writer_threads", "dcp_persist", "finish", "prepare", "save_dcp"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankTarget:
    """Where and as whom a rank saves."""

    layout: CheckpointLayout
    rank: int
    world_size: int
    attempt: str
    """The same on every rank of one launch (decided once, by rank 0 or the launcher): markers mixing attempts
    never make a step."""
    writer_threads: int = 1
    fail_on_error: bool = False
    """Raise a failed save instead of returning ``ok=False`` (training goes on without that step)."""
    remote: Remote | None = None
    """Checkpoints in a bucket: the rank writes into a rank-private scratch dir, then uploads its files and,
    last, its marker object (``pipeline/checkpoint/stores/remote.py``)."""
    dedup: bool = True
    """Share unchanged pieces (frozen parameters, buffers) with the latest committed step instead of writing them
    again (:mod:`pipeline.checkpoint.save.pieces`)."""

    @property
    def store(self) -> CheckpointStore:
        """Where the rank's files go: the checkpoints dir, or the bucket ``remote``."""
        return store_for(self.layout, self.remote)


@dataclass(frozen=True)
class SaveResult:
    """One rank's save of one step: ``ok`` once its marker is written; the bytes of its files and the time."""

    ok: bool
    bytes: int
    """Bytes this rank wrote (its shared pieces taken from the latest committed step not counted)."""
    seconds: float
    error: str = ""
    """Why the save failed (first line of the error, its root cause for DCP's CheckpointException)."""
    shared: int = 0
    """Bytes of this rank's files taken from the latest committed step instead of written."""

    @classmethod
    def of(cls, done: Settled) -> SaveResult:
        """How a settled async save went, as a sync save reports it."""
        return cls(ok=done.ok, bytes=done.bytes, seconds=done.persist_s, error=done.error, shared=done.shared)


def scratch_dir(t: RankTarget, step: int) -> Path:
    """Rank-private: where a rank writes a step it then uploads (``staging/.upload-rank_K/step_N``)."""
    return t.layout.staging / f".upload-rank_{t.rank}" / step_name(step)


def prepare(t: RankTarget, step: int, any_failed: Callable[[bool], bool] | None = None) -> Path:
    """Where this rank writes ``step``: the step's staging dir without this rank's marker from an older attempt
    (with a bucket: this rank's own scratch dir, emptied). ``any_failed`` (a collective every rank calls: true on
    every rank when one passes true): where a rank could not make its dir (a filer away: ``EIO``), every rank
    raises before the collective write, which would otherwise wait for it."""
    try:
        staged = t.store.rank_dir(step, t.rank)
    except Exception:  # an OSError, a store's error: this rank cannot write the step
        if any_failed is not None:
            any_failed(True)
        raise
    if any_failed is not None and any_failed(False):
        raise PipelineError(f"another rank could not prepare its files of step {step} (its own line says why)")
    return staged


def finish(
    t: RankTarget,
    staged: Path,
    step: int,
    fmt: str,
    entries: tuple[FileEntry, ...],
    before_marker: Callable[[], None] = lambda: None,
    reused: frozenset[str] = frozenset(),
    metrics: Metrics | None = None,
) -> None:
    """Check the written files' sizes, then write this rank's done-marker (last, atomically): the one place a
    marker is written. ``before_marker`` may still refuse (raise), e.g. for a writer that was given up on.
    ``reused``: pieces shared with the latest committed step (in a bucket: not in ``staged``, not uploaded).
    ``metrics``: what training reported with the step, recorded in the marker."""
    for entry in entries:
        if entry.path in reused and not (staged / entry.path).exists():
            continue  # a bucket's piece stays where it is
        if (staged / entry.path).stat().st_size != entry.size:
            raise VerificationError(f"{staged / entry.path}: {entry.size} bytes hashed while writing, size differs")
    inject("shard_save.before_marker", rank=t.rank, step=step)
    before_marker()
    marker = Marker(
        step=step, rank=t.rank, world_size=t.world_size, format=fmt, attempt=t.attempt, files=entries,
        metrics=dict(metrics or {}),
    )  # fmt: skip
    t.store.deliver(staged, marker, reused)
    t.store.release(staged)


@dataclass(frozen=True)
class Written:
    """A rank's files of one step (for its marker), and which of them it shared instead of writing."""

    entries: tuple[FileEntry, ...]
    reused: frozenset[str] = frozenset()

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries if e.path not in self.reused)

    @property
    def shared(self) -> int:
        return sum(e.size for e in self.entries if e.path in self.reused)


def write_dcp(
    t: RankTarget,
    staged: Path,
    state: dict[str, Any],
    process_group: Any,
    groups: Mapping[str, str] | None = None,
    writer: RecordingWriter | None = None,
) -> Written:
    """``dcp.save`` of ``state`` into ``staged`` (every file hashed while written and fsync'd on close): this
    rank's files for its marker. ``groups`` (FQN -> shared group) saves those items as pieces that a later step
    shares while unchanged. ``writer`` replaces the default :class:`RecordingWriter` (the async writer passes
    one that reports each file it opens)."""
    writer = writer or RecordingWriter(staged, threads=t.writer_threads)
    writer.pieces = t.store.piece_source(t.rank, staged, groups) if t.dedup and groups else None
    dcp.save(state, storage_writer=writer, process_group=process_group)
    # Data files were hashed while written; rank 0 (DCP's coordinator) also owns the small .metadata.
    entries = tuple(writer.written) + ((describe(staged, METADATA_FILE),) if t.rank == 0 else ())
    return Written(entries, frozenset(writer.reused))


def save_dcp(
    t: RankTarget,
    step: int,
    state: dict[str, Any],
    process_group: Any,
    groups: Mapping[str, str] | None = None,
    metrics: Metrics | None = None,
) -> SaveResult:
    """Save ``state`` for ``step`` with DCP; ``ok`` is true when this rank's marker is written. ``groups``: see
    :func:`write_dcp`; ``metrics``: see :func:`finish`."""
    return save_files(
        t,
        step,
        FORMAT,
        lambda staged: write_dcp(t, staged, state, process_group, groups),
        metrics,
        lambda failed: _any_failed(failed, process_group),
    )


def dcp_persist(
    t: RankTarget, step: int, groups: Mapping[str, str] | None = None, metrics: Metrics | None = None
) -> Persist:
    """What a background writer runs for ``step``: the same files and marker as :func:`save_dcp`, the marker
    only once the files are fsync'd."""

    def persist(staged_state: dict[str, Any], group: Any, progress: Progress) -> tuple[int, int]:
        staged = prepare(t, step, lambda failed: _any_failed(failed, group))
        written = write_dcp(t, staged, staged_state, group, groups, progress.writer(staged))
        progress.written(len(written.entries))
        finish(t, staged, step, FORMAT, written.entries, progress.before_marker, written.reused, metrics)
        return written.bytes, written.shared

    return persist


def _any_failed(failed: bool, group: Any) -> bool:
    """True on every rank of ``group`` when one passes true (the async writer's own group)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def save_files(
    t: RankTarget,
    step: int,
    fmt: str,
    write: Callable[[Path], tuple[FileEntry, ...] | Written],
    metrics: Metrics | None = None,
    any_failed: Callable[[bool], bool] | None = None,
) -> SaveResult:
    """Run ``write`` (this rank's files into the staged dir, returning their entries) and write the marker. Any
    error, the staging dir's own included (see :func:`prepare` for ``any_failed``), is a failed save in one
    line, never a crashed job (unless ``fail_on_error``)."""
    t0 = time.monotonic()
    staged: Path | str = t.store.staged_where(step)
    try:
        staged = prepare(t, step, any_failed)
        out = write(staged)
        written = out if isinstance(out, Written) else Written(out)
        entries = written.entries
        finish(t, staged, step, fmt, entries, reused=written.reused, metrics=metrics)
    except (Exception, CheckpointException) as e:  # dcp.save reports a rank's I/O error as a BaseException
        log.error(
            "SHARD SAVE FAILED: rank %d step %d into %s: %s — this step will not be committed%s",
            t.rank,
            step,
            staged,
            e,
            "" if t.fail_on_error else "; training continues",
        )
        if t.fail_on_error:
            raise
        return SaveResult(ok=False, bytes=0, seconds=time.monotonic() - t0, error=exception_line(e))
    seconds = time.monotonic() - t0
    if written.reused:
        log.info(
            "rank %d saved step %d (%d files, %d shared with the latest committed step: %d bytes not written) in %.2fs",
            t.rank,
            step,
            len(entries),
            len(written.reused),
            written.shared,
            seconds,
        )
    else:
        log.info("rank %d saved step %d (%d files) in %.2fs", t.rank, step, len(entries), seconds)
    return SaveResult(ok=True, bytes=written.bytes, seconds=seconds, shared=written.shared)
