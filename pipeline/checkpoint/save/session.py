"""The save session: the one save path of a training job, driven by the library's
:class:`~pipeline.checkpoint.Checkpointer` and by the app's train stage alike.

A :class:`CheckpointSession` is one rank's side of the checkpoint protocol for one launch:

* :meth:`~CheckpointSession.save` (DCP) and :meth:`~CheckpointSession.save_files` (a strategy that writes its own
  files: DeepSpeed, :mod:`pipeline.checkpoint.save.deepspeed_engine`) write this rank's files and its done-marker
  (:mod:`pipeline.checkpoint.save.rank_save`), after settling a pending async save;
* :meth:`~CheckpointSession.save_async` stages the state into a reused buffer and persists it in the background
  (:mod:`pipeline.checkpoint.save.async_save`); :meth:`~CheckpointSession.wait` settles it (deadline-bounded);
* every save ends in one agreement: a single ``all_gather`` of every rank's outcome, so every rank takes the same
  verdict and rank 0 names the ranks that failed (:class:`Agreed`). A step a rank could not save is never
  committed; with ``fail_on_error`` the session raises instead of training on;
* :meth:`~CheckpointSession.load_latest`: rank 0 decides the resume step (:mod:`pipeline.checkpoint.resume`),
  broadcasts it, and every rank loads it through the caller's loader.

What is not the protocol stays with the caller: the app writes its ``metrics.jsonl`` events, TensorBoard and the
stage record from the ``on_agreed`` hook and around the calls; the library adds its schedule, preemption flag
and committer. Every collective runs on ``group`` (a gloo group of the caller's own, with a deadline), and every
rank calls each method at the same point of training.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.checkpoint.manifest import Manifest, Metrics, read_manifest
from pipeline.checkpoint.save import rank_save
from pipeline.checkpoint.save.async_save import AsyncSaver
from pipeline.checkpoint.save.rank_save import RankTarget, SaveResult, Written
from pipeline.errors import PipelineError, ReadFailed, VerificationError
from pipeline.storage.integrity import FileEntry

log = logging.getLogger(__name__)

__all__ = ["Agreed", "CheckpointSession"]


@dataclass(frozen=True)
class Agreed:
    """One save of one step as every rank agreed to take it: each rank's outcome and how long it blocked."""

    step: int
    mode: str
    """``sync`` or ``async``."""
    outcomes: tuple[SaveResult, ...]
    """Rank ``K``'s result at index ``K``."""
    blocked: tuple[float, ...]
    """Seconds each rank's training was blocked by this save."""
    persist_s: float | None = None
    """An async save: this rank's writer's time from start to marker."""

    @property
    def failed(self) -> dict[int, str]:
        return {r: o.error for r, o in enumerate(self.outcomes) if not o.ok}

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    @property
    def why(self) -> str:
        """What failed, the same text on every rank ("" when every rank saved)."""
        return "; ".join(f"rank {r}: {e}" for r, e in self.failed.items())

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in self.outcomes)

    @property
    def shared(self) -> int:
        return sum(o.shared for o in self.outcomes)

    @property
    def seconds(self) -> float:
        """The ranks save in parallel: the slowest sets the time."""
        return max(o.seconds for o in self.outcomes)

    @property
    def blocked_s(self) -> float:
        return max(self.blocked)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


Write = Callable[[Path], tuple[FileEntry, ...] | Written]
"""A strategy's own save of this rank's files into the staged dir it is given, returning them."""


def _floor_or_why(floor: Callable[[], int]) -> int | str:
    """Rank 0: the durable tier's newest step, or why it cannot be read now (every rank raises it)."""
    try:
        return floor()
    except ReadFailed as e:
        return str(e)


FAILING_LOUD = 3
"""Saves failed in a row after which rank 0 says so once, louder (a storage outage that lasts)."""


class CheckpointSession:
    """One rank's save path for one launch: save, save_async, wait, the agreement and the resume decision."""

    def __init__(
        self,
        target: RankTarget,
        group: Any,
        *,
        async_deadline_s: float,
        on_agreed: Callable[[Agreed], None] | None = None,
        stop_hint: str = "",
        continue_hint: str = "",
    ) -> None:
        """``target``: where and as whom this rank saves. ``group``: the checkpoint collectives' group (never
        the training group). ``async_deadline_s`` bounds the wait for a background writer. ``on_agreed`` is
        called on every rank after each agreement (the app's events). ``stop_hint`` ends the error raised for a
        failed async save with ``target.fail_on_error``; ``continue_hint`` ends the error logged otherwise."""
        self.target = target
        self.group = group
        self.rank, self.world_size = target.rank, target.world_size
        self.async_deadline_s = async_deadline_s
        self.on_agreed = on_agreed
        self.stop_hint, self.continue_hint = stop_hint, continue_hint
        self.saver: AsyncSaver | None = None
        self.saved: list[int] = []
        """Steps every rank saved (in this launch)."""
        self.failed: list[int] = []
        self.errors: dict[int, str] = {}
        """Why each failed step failed, every rank's error named."""

    # -- collectives -------------------------------------------------------------------------------------------

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any (every rank acts at the same step)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    # -- save --------------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: dict[str, Any],
        groups: Mapping[str, str] | None = None,
        started: float | None = None,
        metrics: Metrics | None = None,
    ) -> SaveResult:
        """Save the DCP state dict ``state`` as ``step`` (blocking), after settling a pending async save; returns
        this rank's result with every rank's verdict in ``ok``. ``groups``: the FQNs saved as shared pieces
        (:mod:`pipeline.checkpoint.save.pieces`). ``started``: when training stopped for this save (monotonic).
        ``metrics``: recorded in the step's marker (rank 0's reach the manifest)."""
        t0 = time.monotonic() if started is None else started
        self.wait()
        result = rank_save.save_dcp(self.target, step, state, self.group, groups, metrics)
        return self.agree(step, result, time.monotonic() - t0)

    def save_files(
        self, step: int, fmt: str, write: Write, started: float | None = None, metrics: Metrics | None = None
    ) -> SaveResult:
        """:meth:`save` for a strategy that writes its own files (``write(staged_dir)``, e.g. DeepSpeed's), in
        format ``fmt``."""
        t0 = time.monotonic() if started is None else started
        self.wait()
        result = rank_save.save_files(self.target, step, fmt, write, metrics, self.any_rank)
        return self.agree(step, result, time.monotonic() - t0)

    def save_async(
        self,
        step: int,
        state: dict[str, Any],
        groups: Mapping[str, str] | None = None,
        started: float | None = None,
        metrics: Metrics | None = None,
    ) -> float:
        """Settle the previous async save, copy ``state`` into the reused staging buffer and persist it in the
        background (the same files and marker as :meth:`save`); returns the seconds training was blocked."""
        t0 = time.monotonic() if started is None else started
        self.wait()
        if self.saver is None:
            self.saver = AsyncSaver(self.rank, self.group, self.async_deadline_s, self.target.writer_threads)
        persist = rank_save.dcp_persist(self.target, step, groups, metrics)
        return self.saver.start(step, state, persist, time.monotonic() - t0)

    @property
    def pending_step(self) -> int | None:
        """The step an async save is writing (None when none is pending)."""
        return None if self.saver is None else self.saver.pending_step

    def wait(self) -> SaveResult | None:
        """Settle the pending async save (deadline-bounded, every rank leaving the wait at the same poll) and
        agree on it; None if none is pending. After a failure every rank drops its writer, buffer and group
        alike, then trains on without the step or (``fail_on_error``) raises."""
        if self.saver is None or self.saver.pending_step is None:
            return None
        done = self.saver.wait()
        if done is None:
            return None
        result = self.agree(done.step, SaveResult.of(done), done.blocked_s, persist_s=done.persist_s)
        if result.ok:
            return result
        self.saver.discard()
        if self.target.fail_on_error:
            raise PipelineError(f"async save of step {done.step} failed ({result.error}){self.stop_hint}")
        if self.rank == 0:
            log.error("step %d is not saved (%s); training continues%s", done.step, result.error, self.continue_hint)
        return result

    def agree(self, step: int, result: SaveResult, blocked_s: float, persist_s: float | None = None) -> SaveResult:
        """Every rank's outcome of ``step`` (one ``all_gather`` of a few numbers per rank; the error texts are
        gathered only when a rank failed): ``ok`` only if every rank saved, the same verdict and error text on
        every rank; rank 0 logs the ranks that failed."""
        mine = torch.tensor([result.ok, result.bytes, result.shared, result.seconds, blocked_s], dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.group)
        numbers = [row.tolist() for row in rows]
        errors: list[Any] = [""] * self.world_size
        if not all(ok for ok, *_ in numbers):  # every rank sees the same numbers: all of them gather, or none
            dist.all_gather_object(errors, result.error, group=self.group)
        agreed = Agreed(
            step=step,
            mode="sync" if persist_s is None else "async",
            outcomes=tuple(
                SaveResult(ok=bool(ok), bytes=int(size), seconds=seconds, error=str(error), shared=int(shared))
                for (ok, size, shared, seconds, _), error in zip(numbers, errors, strict=True)
            ),
            blocked=tuple(row[4] for row in numbers),
            persist_s=persist_s,
        )
        if agreed.ok:
            self.saved.append(step)
        else:
            self.failed.append(step)
            self.errors[step] = agreed.why
            self._say_louder(step, agreed.why)
            if self.rank == 0:
                log.error(
                    "step %d was not saved by rank(s) %s; it will not be committed: %s",
                    step,
                    sorted(agreed.failed),
                    agreed.why,
                )
        if self.on_agreed is not None:
            self.on_agreed(agreed)
        return result if agreed.ok else dataclasses.replace(result, ok=False, error=agreed.why)

    def _say_louder(self, step: int, why: str) -> None:
        """Rank 0, once per run of failures: :data:`FAILING_LOUD` saves in a row failed (a storage outage that
        lasts): training goes on, but nothing newer is being checkpointed."""
        in_a_row = 0
        for s in reversed(sorted(self.saved + self.failed)):
            if s in self.saved:
                break
            in_a_row += 1
        if self.rank == 0 and in_a_row == FAILING_LOUD:
            newest = max(self.saved, default=None)
            log.error(
                "CHECKPOINTS ARE NOT BEING SAVED: the last %d saves failed (up to step %d; the newest step saved in "
                "this launch: %s); training goes on, and a crash now loses every step since. Last error: %s",
                in_a_row, step, newest if newest is not None else "none", why,
            )  # fmt: skip

    # -- resume ------------------------------------------------------------------------------------------------

    def load_latest(
        self,
        decide: Callable[[], int | str],
        load: Callable[[Path, Manifest], int],
        first: Callable[[int], int | None] | None = None,
        floor: Callable[[], int] | None = None,
    ) -> int:
        """The resume step, decided once: rank 0 calls ``decide`` (a step, 0 for none, or why it cannot be
        decided, which every rank raises) and broadcasts it; every rank then calls ``load(step_dir, manifest)``,
        which returns the step the loaded state records (checked). Returns the step (0: start fresh).

        With ``first`` (a faster tier), rank 0's ``floor()`` (the durable tier's newest step, unverified) goes to
        every rank first, and ``first(floor)`` (every rank) restores a step at least that new or returns None."""
        if first is not None and floor is not None:
            lowest = self.broadcast(_floor_or_why(floor) if self.rank == 0 else None)
            if isinstance(lowest, str):  # unknown: never a fast copy older than the durable step for it
                raise ReadFailed(f"cannot resume: {lowest}")
            fast = first(int(lowest))
            if fast is not None:
                return fast
        decided = self.broadcast(decide() if self.rank == 0 else None)
        if isinstance(decided, str):
            raise VerificationError(decided)
        step = int(decided)
        if step == 0:
            return 0
        step_dir = self.target.layout.committed_step(step)
        manifest = read_manifest(step_dir)  # rank 0 verified the step's files against it
        recorded = load(step_dir, manifest)
        if recorded != step:
            raise VerificationError(f"{step_dir} records step {recorded}, not {step}")
        log.debug("rank %d resumed from step %d (%s)", self.rank, step, step_dir)  # rank 0 logs one INFO line
        return step

    # -- end ---------------------------------------------------------------------------------------------------

    def abandon(self, why: str) -> None:
        """Training is failing: give a pending async save up (bounded, this rank only: no collective)."""
        if self.saver is not None:
            self.saver.abandon(why)
