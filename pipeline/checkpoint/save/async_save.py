"""Async save (``checkpoint.async_save=true``, DDP/FSDP2): training is blocked only while the state is copied
into a staging buffer; a background daemon thread persists the copy.

Inputs: a rank's DCP state dict at a checkpoint step (CPU or CUDA tensors, FSDP2's DTensors) and a ``persist``
function that writes the staged copy and then the rank's done-marker (shard-save's, which owns the marker).
Outputs: whatever ``persist`` writes (``checkpoints/staging/step_N/``), and, once every rank agreed on how it
ended, a :class:`Settled` record per save (ok, bytes, blocked and persist seconds, or why it failed).
Owner: each rank's :class:`AsyncSaver` owns its staging buffer (allocated once, refreshed by copying into it;
pinned when the state is on a GPU), its writer thread and the writer's own gloo process group.

No wait here is unbounded: :meth:`AsyncSaver.wait` polls with the deadline ``checkpoint.async_deadline_s`` and
a liveness check (the thread alive, its recorded exception), and the ranks agree on the outcome with a small
all-reduce on the control group at every poll, so all of them leave the wait at the same poll. A writer that
died or stalled is given up (:meth:`AsyncSaver.discard`): as a daemon it never holds up the interpreter's exit,
and its group is never destroyed under it; the next save gets a fresh buffer and a fresh group, created on
every rank. Fault points (``PIPELINE_FAULTS``): ``async_save.before_write``, ``async_save.mid_write`` (each
file as it is opened, with ``file=``) and ``async_save.after_write`` (files durable, before the marker).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from pipeline.errors import PipelineError, exception_line
from pipeline.formats.dcp import RecordingWriter
from pipeline.storage.faults import inject

log = logging.getLogger(__name__)

_LIVE: list[_Job] = []
"""Every writer started by this process (pruned as they end): :func:`stuck_writers` reads it."""


class AbandonedWrite(PipelineError):
    """The writer was given up on by training (deadline or another rank's failure): it must not go on."""


@dataclass(frozen=True)
class Settled:
    """How one rank's async save of ``step`` ended, as every rank agreed to take it."""

    step: int
    ok: bool
    bytes: int
    blocked_s: float
    """Training was blocked this long by the save: waiting for the previous one, plus the staging copy."""
    persist_s: float
    """The writer's time from start to marker (0 when it did not finish)."""
    error: str = ""
    shared: int = 0
    """Bytes shared with the latest committed step instead of written (:mod:`pipeline.checkpoint.save.pieces`)."""


@dataclass
class _Job:
    step: int
    rank: int
    blocked_s: float
    started: float = field(default_factory=time.monotonic)
    doing: str = "starting"
    bytes: int | None = None
    shared: int = 0
    persist_s: float = 0.0
    error: BaseException | None = None
    abandoned: bool = False
    thread: threading.Thread | None = None

    def status(self) -> str:
        """``done``, ``failed`` or ``running`` (liveness: a thread that ended without a result has failed)."""
        if self.bytes is not None:
            return "done"
        if self.error is not None or self.thread is None or not self.thread.is_alive():
            return "failed"
        return "running"

    def describe(self) -> str:
        if self.error is not None:
            return f"async writer of step {self.step} on rank {self.rank} died: {exception_line(self.error)}"
        if self.bytes is None and (self.thread is None or not self.thread.is_alive()):
            return f"async writer of step {self.step} on rank {self.rank} ended without a result"
        return (
            f"async writer of step {self.step} on rank {self.rank} has not finished after "
            f"{time.monotonic() - self.started:.1f} s; last: {self.doing}"
        )


class Progress:
    """What ``persist`` reports from inside the writer thread (and where the fault points are)."""

    def __init__(self, job: _Job, threads: int) -> None:
        self._job = job
        self._threads = threads

    def writer(self, staged: Path) -> RecordingWriter:
        """The DCP storage writer to use: a :class:`RecordingWriter` that reports each file it opens."""
        return _ReportingWriter(staged, self._threads, self._on_file, self._on_written)

    def doing(self, what: str) -> None:
        self._job.doing = what

    def written(self, files: int) -> None:
        """Every file is written and fsync'd: the marker comes next."""
        self.doing(f"{files} file(s) written and fsync'd, before the done-marker")
        inject("async_save.after_write", rank=self._job.rank, step=self._job.step)

    def before_marker(self) -> None:
        if self._job.abandoned:
            raise AbandonedWrite(f"step {self._job.step} on rank {self._job.rank} was given up on by training")
        self.doing("writing the done-marker")

    def _on_file(self, name: str) -> None:
        self.doing(f"writing file {name}")
        inject("async_save.mid_write", rank=self._job.rank, step=self._job.step, file=name)
        if self._job.abandoned:
            raise AbandonedWrite(f"step {self._job.step} on rank {self._job.rank} was given up on by training")

    def _on_written(self) -> None:
        self.doing("data files written; waiting for the other ranks (DCP metadata and finish)")


Persist = Callable[[dict[str, Any], Any, Progress], tuple[int, int]]
"""Writes the staged state through the given group and progress; returns the bytes written and those shared with
the latest committed step instead."""


class AsyncSaver:
    """One rank's background saves, one at a time: :meth:`start`, :meth:`wait` (collective), :meth:`discard`,
    and :meth:`abandon` (local, for a training that is failing)."""

    def __init__(self, rank: int, control_group: Any, deadline_s: float, threads: int) -> None:
        self.rank = rank
        self.control = control_group
        self.deadline_s = deadline_s
        self.threads = threads
        self._buffer: dict[str, Any] | None = None
        self._group: Any = None
        self._job: _Job | None = None

    @property
    def pending_step(self) -> int | None:
        return None if self._job is None else self._job.step

    def staging_buffer(self) -> dict[str, Any] | None:
        """The reused staging copy (tests check that saves reuse it)."""
        return self._buffer

    def start(self, step: int, state: dict[str, Any], persist: Persist, waited_s: float = 0.0) -> float:
        """Copy ``state`` into the staging buffer and start the writer; returns how long training was blocked
        (``waited_s`` for the previous save plus the copy). Every rank calls it at the same step (it may create
        the writer's group, a collective); the previous save must be settled first."""
        if self._job is not None:
            raise PipelineError(
                f"async save of step {step} on rank {self.rank} started while step {self._job.step} is pending: "
                "wait() for it first"
            )
        t0 = time.monotonic()
        if self._group is None:  # collective, on every rank alike: none has a group, or all just discarded theirs
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.deadline_s))
        staged = self._stage(state)
        blocked = waited_s + time.monotonic() - t0
        job = _Job(step=step, rank=self.rank, blocked_s=blocked)
        job.thread = threading.Thread(
            target=self._run,
            args=(job, staged, self._group, persist),
            name=f"async-save-step{step}",
            daemon=True,  # a stuck writer never holds up the interpreter's exit (nor do DCP's threads it starts)
        )
        _LIVE[:] = [j for j in _LIVE if j.thread is not None and j.thread.is_alive()]
        _LIVE.append(job)
        self._job = job
        job.thread.start()
        log.info("rank %d: async save of step %d started (training blocked %.3f s)", self.rank, step, blocked)
        return blocked

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """The staged copy of ``state``: its tensors are the reused buffer's, refreshed in place."""
        on_gpu = any(t.is_cuda for t in _tensors(state))
        if self._buffer is not None:
            try:
                return self._copy(state, on_gpu)
            except Exception as e:  # the state's structure changed (e.g. new optimizer state): stage anew
                log.info("rank %d: staging buffer re-allocated (%s)", self.rank, exception_line(e))
                self._buffer = None
        self._buffer = _create_cpu_state_dict(state, pin_memory=on_gpu and torch.cuda.is_available())
        return self._copy(state, on_gpu)

    def _copy(self, state: dict[str, Any], on_gpu: bool) -> dict[str, Any]:
        if self._buffer is None:  # internal invariant: _stage allocates it first
            raise PipelineError("async save: no staging buffer to copy into")
        # The returned dict holds the buffer's tensors and the state's current non-tensor values (deep-copied
        # when mutable), so the writer never sees training change anything under it.
        staged = _copy_state_dict(state, self._buffer, non_blocking=on_gpu, type_check=False)
        if on_gpu:
            torch.cuda.synchronize()  # the pinned copies have landed before the writer reads them
        return staged

    def _run(self, job: _Job, staged: dict[str, Any], group: Any, persist: Persist) -> None:
        try:
            job.doing = "before writing"
            inject("async_save.before_write", rank=job.rank, step=job.step)
            job.doing = "planning the save with the other ranks"
            written, job.shared = persist(staged, group, Progress(job, self.threads))
            job.persist_s = time.monotonic() - job.started
            job.bytes = written
            job.doing = "done"
            log.info(
                "rank %d: async save of step %d persisted (%d bytes) in %.2f s",
                job.rank,
                job.step,
                written,
                job.persist_s,
            )
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one; the thread records all
            job.error = e
            job.persist_s = time.monotonic() - job.started
            if job.abandoned:
                log.warning(
                    "rank %d: abandoned async writer of step %d ended: %s", job.rank, job.step, exception_line(e)
                )
            else:
                log.error(
                    "ASYNC WRITER DIED: step %d rank %d after %.2f s (%s): %s",
                    job.step,
                    job.rank,
                    job.persist_s,
                    job.doing,
                    exception_line(e),
                )

    def wait(self) -> Settled | None:
        """Wait for the pending save (None if there is none) until it ended on every rank, any rank's writer
        failed, or the deadline passed on any rank; every rank leaves at the same poll. A collective on the
        control group: every rank calls it at the same point of training."""
        job = self._job
        if job is None:
            return None
        start, interval = time.monotonic(), 0.002
        while True:
            status = job.status()
            over = time.monotonic() - start > self.deadline_s
            flags = torch.tensor([status == "failed", status == "running", over], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
            failed, running, late = (bool(x) for x in flags.tolist())
            if failed or late or not running:
                break
            time.sleep(interval)
            interval = min(interval * 2, 0.1)
        self._job = None
        status = job.status()
        if status == "done":
            return Settled(job.step, True, job.bytes or 0, job.blocked_s, job.persist_s, shared=job.shared)
        why = (
            job.describe()
            if status != "running" or late
            else f"{job.describe()}; given up: another rank's writer failed"
        )
        log.error("ASYNC SHARD SAVE FAILED: %s — step %d will not be committed", why, job.step)
        return Settled(job.step, False, 0, job.blocked_s, 0.0, error=why)

    def discard(self) -> None:
        """After a failed save (every rank calls it, so the next group is created on every rank): the writer
        is given up on (it refuses to write a marker if it ever gets that far), the buffer and the group it may
        still use are dropped, never destroyed under it; the next save stages into a fresh buffer."""
        for job in _LIVE:
            if job.thread is not None and job.thread.is_alive() and job.rank == self.rank:
                job.abandoned = True
        self._buffer = None
        self._group = None

    def abandon(self, why: str) -> None:
        """Training is stopping with an error: give the pending save up to the deadline (polling this rank's
        writer only, no collective: other ranks may be gone) and say how it ended, so that it is never dropped
        silently."""
        job, self._job = self._job, None
        if job is None:
            return
        start = time.monotonic()
        while job.status() == "running" and time.monotonic() - start < self.deadline_s:
            time.sleep(0.05)
        if job.status() == "done":
            log.warning("rank %d: async save of step %d finished while training stopped (%s)", job.rank, job.step, why)
        else:
            log.error("ASYNC SHARD SAVE LOST: %s, while training stopped (%s)", job.describe(), why)
        job.abandoned = True
        self._buffer = None
        self._group = None


def stuck_writers() -> list[str]:
    """Writers of this process still running (given up on, or never waited for): the process groups must not
    be destroyed under them."""
    return [j.describe() for j in _LIVE if j.thread is not None and j.thread.is_alive()]


class _ReportingWriter(RecordingWriter):
    """A :class:`RecordingWriter` that reports each file as it is opened and when the data files are done."""

    def __init__(
        self, path: Path, threads: int, on_file: Callable[[str], None], on_written: Callable[[], None]
    ) -> None:
        super().__init__(path, threads=threads, on_file=on_file)
        self._on_written = on_written

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        self._on_written()
        return fut


def _tensors(obj: Any) -> Generator[torch.Tensor, None, None]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)
