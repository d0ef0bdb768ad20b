"""The one committer: verifies staged steps, publishes them, and only then moves ``latest``.

Inputs: ``checkpoints/staging/step_N/`` with each rank's ``rank_K.done.json``.
Outputs: ``checkpoints/step_N/manifest.json`` and the step published in one act (POSIX: a directory rename),
then ``checkpoints/latest`` replaced atomically; steps whose files fail their marker's size or hash move to
``checkpoints/quarantine/`` (never deleted) and the error names the file; retention after each commit.

The same :class:`Committer` runs in the app's verify-manifest job, in a ``torchrun`` script's rank 0 (a
background thread of :class:`~pipeline.checkpoint.Checkpointer`), and in ``python -m pipeline.commit``. Exactly
commits a checkpoint dir at a time: :meth:`Committer.hold` takes the committer lease (a record with a fencing epoch
and a heartbeat, :mod:`pipeline.checkpoint.ownership`; ``flock`` only as a fast path on one node), and checks it
before every act that changes the checkpoints.

Since no shared filesystem gives exclusion across nodes, a second committer (an operator's, or a ghost that
comes back after a partition) can still act once between its last check and its act. Every such act is
harmless: the manifest is a function of the staged attempt alone, so whoever writes it writes the same bytes and
whoever publishes publishes the same step (a publish that finds the step already published by the other accepts
it); a staged step that vanishes while it is verified is the other's publish, never damage to quarantine;
``latest`` is never moved to an older step than the one it names while that step is published; retention and
quarantine tolerate entries another committer already moved.

Every :meth:`Committer.recover` first re-verifies the step ``latest`` names: damage there (a changed or missing
file, a manifest that is not the one ``latest`` recorded, garbage in ``latest`` itself) is quarantined and
``latest`` goes back to the newest committed step that verifies. A damaged file that several steps hold (a piece
of an incremental save, hard-linked) takes every committed step holding it to quarantine
(:func:`~pipeline.checkpoint.repair.quarantine_damage`). Nothing is followed through a symlink.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pipeline.checkpoint import repair, retention
from pipeline.checkpoint.duplicates import RACES, DuplicateTolerance
from pipeline.checkpoint.manifest import (
    MANIFEST,
    Marker,
    complete_markers,
    describe_incomplete,
    pointer_step,
    read_latest,
    read_newest,
    staged_world,
    step_markers,
    verify_committed,
    write_latest,
    write_manifest,
)
from pipeline.checkpoint.ownership import (
    DEFAULT_LEASE_S,
    LEASE,
    CommitterBusy,
    CommitterLease,
    CommitterLost,
    FileLease,
    LeaseStore,
)
from pipeline.checkpoint.repair import step_entries
from pipeline.checkpoint.step_checks import verified_manifest
from pipeline.errors import DeadlineError, PipelineError, VerificationError
from pipeline.storage.backend import POSIX, Storage
from pipeline.storage.faults import inject
from pipeline.storage.integrity import hash_file
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.waiting import wait_until

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitPolicy:
    """How the committer waits, what it may read, and what it keeps."""

    world_size: int
    """Markers a staged step needs when its rank-0 marker does not say (the run's world size)."""
    marker_deadline_s: float = 600.0
    """How long the last pass waits for a step's missing markers while its producer is alive."""
    poll_interval_s: float = 1.0
    """How often a following committer looks for newly staged steps."""
    allow_pickle: bool = False
    """Whether a format's files that need full unpickling may be read (an imported checkpoint the user trusts)."""
    keep_last: int | None = None
    keep_every: int | None = None
    keep_outputs_last: int | None = None
    lease_s: float = DEFAULT_LEASE_S
    """The committer lease: a holder whose heartbeat is older than this is gone, and another may take over."""


@dataclass
class CommitReport:
    """What one committer run did: committed steps (with the unix time of each commit), and what it refused."""

    committed: dict[int, float] = field(default_factory=dict)
    quarantined: list[str] = field(default_factory=list)
    incomplete: list[tuple[int, str]] = field(default_factory=list)


__all__ = ["CommitPolicy", "CommitReport", "Committer", "CommitterBusy", "CommitterLost"]


def latest_step(layout: CheckpointLayout) -> int:
    """The newest committed step (0: none): ``latest``, or a newer published step when ``latest`` lags."""
    latest = read_newest(layout)
    return latest.step if latest else 0


def staged_uncommitted(layout: CheckpointLayout, world_size: int, upto: int | None = None) -> list[int]:
    """Steps newer than ``latest`` staged with every rank's marker (one attempt) but not committed yet: what a
    resuming trainer waits for, so a step staged before a kill is never lost nor trained again."""
    try:
        done = latest_step(layout)
    except (VerificationError, OSError, ValueError):
        return []  # the committer repairs latest first; resuming then reports what it found
    pending = []
    for step, staged in step_entries(POSIX, layout.staging):
        if step <= done or (upto is not None and step > upto) or POSIX.kind(staged) != "dir":
            continue
        try:
            if complete_markers(step_markers(staged, step, staged_world(staged, step, world_size)), None):
                pending.append(step)
        except VerificationError:
            continue
    return pending


class Committer(DuplicateTolerance):
    """Commits the staged steps of one checkpoint dir. Not thread-safe: one thread drives it."""

    policy: CommitPolicy

    def __init__(
        self,
        layout: CheckpointLayout,
        policy: CommitPolicy,
        storage: Storage = POSIX,
        save_errors: Callable[[], dict[int, str]] = dict,
    ) -> None:
        """``save_errors()``: why the producer could not save a step, when it says (named beside a missing marker)."""
        self.layout = layout
        self.policy = policy
        self.storage = storage
        self.save_errors = save_errors
        self.report = CommitReport()
        self.lease: CommitterLease | None = None

    def lease_store(self) -> LeaseStore:
        """Where this committer's lease record lives (beside the checkpoints it commits)."""
        return FileLease(self.layout.checkpoints / LEASE)

    @contextlib.contextmanager
    def hold(self, takeover: bool = False) -> Iterator[None]:
        """Be the one committer of these checkpoints for the block, or raise :class:`CommitterBusy` naming the
        live holder. ``takeover``: this process was made the owner by the scheduler or the training job (the
        run's committer job, rank 0 of a process group), so a live holder is fenced off rather than obeyed."""
        self.storage.makedirs(self.layout.checkpoints)
        with self.storage.exclusive(self.layout.committer_lock) as mine:  # one node: the kernel's lock, fast
            if not mine:
                raise CommitterBusy(
                    f"another committer holds {self.layout.committer_lock}: exactly one commits "
                    f"{self.layout.checkpoints} (stop the other one, or let it finish)"
                )
            lease = CommitterLease(self.lease_store(), self.policy.lease_s)
            lease.acquire(takeover)
            self.lease = lease
            try:
                yield
            finally:
                lease.release()

    def fence(self) -> None:
        """Before an act that changes the checkpoints: raise :class:`CommitterLost` if another holds the lease."""
        if self.lease is not None:
            self.lease.fence()

    def check_lost(self) -> None:
        """Between passes, without I/O: raise :class:`CommitterLost` if the heartbeat saw the lease taken."""
        lost = self.lease.lost() if self.lease is not None else None
        if lost is not None:
            raise CommitterLost(lost)

    # -- the passes --------------------------------------------------------------------------------------------

    def recover(self) -> None:
        """What a committer does first: remove its own litter, re-verify ``latest`` (quarantining damage), and
        finish a commit that was interrupted between publishing a step and moving ``latest``."""
        repair.sweep_temp_files(self.storage, self.layout)
        self._finish_unmanifested()  # before latest is judged: its step may be one
        self.report.quarantined += repair.recheck_latest(self.storage, self.layout)
        after = pointer_step(self.layout)
        for step, path in step_entries(self.storage, self.layout.checkpoints):
            if step <= after or self.storage.kind(path) != "dir" or self.storage.kind(path / MANIFEST) != "file":
                continue
            try:
                verify_committed(path, step)
            except VerificationError as e:  # published, then damaged: never left above latest to fail every start
                where, shared = repair.quarantine_damage(self.storage, self.layout, path, str(e), step)
                self.report.quarantined += [f"step {step}: {e} (moved to {where})", *shared]
                after = pointer_step(self.layout)
                continue
            write_latest(self.layout, step, hash_file(path / MANIFEST))
            log.warning("step %d was published but latest was not moved (interrupted commit): latest -> %d", step, step)
            self.report.committed[step] = time.time()

    def commit_ready(self) -> list[int]:
        """One look: commit every staged step newer than ``latest`` whose markers are all there (one attempt)
        and whose files verify; quarantine one that does not. Steps still incomplete are left for later."""
        done = []
        self._finish_unmanifested()
        try:
            latest_step(self.layout)
        except VerificationError:  # a damaged latest, or a stale committer's pointer to a step retired since
            self.report.quarantined += repair.recheck_latest(self.storage, self.layout)
        for step in self._candidates() + self._holes():
            staged = self.layout.staged_step(step)
            if self.storage.kind(self.layout.committed_step(step)) is not None or self.storage.kind(staged) != "dir":
                continue
            try:
                markers = complete_markers(
                    step_markers(staged, step, staged_world(staged, step, self.policy.world_size)), None
                )
            except VerificationError:
                continue  # damaged markers: the last pass quarantines the step
            if markers is not None and self._commit_or_quarantine(step, markers):
                done.append(step)
        self._catch_up_latest()
        return done

    def follow(self, alive: Callable[[], bool], stop: Callable[[], bool] = lambda: False) -> None:
        """Commit each step as soon as it is complete while the producer is ``alive()`` (and ``stop()`` is not
        set); returns after one more look once it is not."""
        while True:
            self.check_lost()
            running = alive() and not stop()
            self.commit_ready()
            if not running:
                return
            time.sleep(self.policy.poll_interval_s)

    def finish(self, attempt: str | None, alive: Callable[[], bool]) -> None:
        """The last pass: each staged step newer than ``latest`` waits for its markers (deadline, liveness) and
        is committed or quarantined; steps that cannot complete are recorded in the report."""
        for step in self._candidates():
            if self.storage.kind(self.layout.committed_step(step)) is not None:
                log.warning("step %d is staged again but already published; the staged copy is left alone", step)
                continue
            try:
                markers = self._wait_for_markers(step, attempt, alive)
            except DeadlineError as e:
                self.report.incomplete.append((step, str(e)))
                continue
            except VerificationError as e:
                self._quarantine_step(step, e)
                continue
            self._commit_or_quarantine(step, markers)

    def latest_step(self) -> int:
        """The step ``latest`` names (0: none)."""
        return latest_step(self.layout)

    def raise_problems(self) -> None:
        """Fail (one line) if a step was quarantined or a step newer than ``latest`` could not complete."""
        newest = self.latest_step()
        reported = self.save_errors()
        pending = [
            msg + (f" (the trainer reported: {reported[s]})" if s in reported else "")
            for s, msg in self.report.incomplete
            if s > newest
        ]
        if self.report.quarantined or pending:
            raise VerificationError("; ".join(self.report.quarantined + pending) + f" (latest stays at step {newest})")
        for step, msg in self.report.incomplete:
            log.warning("incomplete step %d is superseded by committed step %d; left in staging: %s", step, newest, msg)

    def is_clean(self) -> int | None:
        """``latest``'s step when it verifies, nothing newer is staged or published, and nothing is planted;
        else None (a committer has work to do)."""
        try:
            newest = read_latest(self.layout)
            if newest is None or self._candidates() or repair.planted(self.storage, self.layout):
                return None
            if any(s > newest.step for s, _ in step_entries(self.storage, self.layout.checkpoints)):
                return None
            verify_committed(self.layout.committed_step(newest.step), newest.step)
        except (VerificationError, OSError, ValueError):
            return None
        return newest.step

    # -- one step ----------------------------------------------------------------------------------------------

    def pending(self) -> list[int]:
        """Staged steps newer than ``latest`` (complete or not): work a following committer still expects."""
        return self._candidates()

    def _candidates(self) -> list[int]:
        after = latest_step(self.layout)
        return [s for s, _ in step_entries(self.storage, self.layout.staging) if s > after]

    def _commit_or_quarantine(self, step: int, markers: list[Marker]) -> bool:
        try:
            self.commit(step, markers)
        except VerificationError as e:
            if self._taken_by_another(step, wait=self._interfered(step)):
                return False
            self._quarantine_step(step, e)
            return False
        except OSError as e:  # the staged step vanished under the check: another committer's, or a real I/O error
            if e.errno not in RACES:
                raise
            if self._taken_by_another(step, wait=True):
                return False
            log.warning("step %d: %s (another committer at work on it?): looked at again next pass", step, e)
            return False
        self.report.committed[step] = time.time()
        self.fence()
        retention.apply(self.layout, self.policy, latest_step=latest_step(self.layout) or None)
        return True

    def _quarantine_step(self, step: int, e: Exception) -> None:
        self.fence()
        staged = self.layout.staged_step(step)
        try:
            where, shared = repair.quarantine_damage(self.storage, self.layout, staged, str(e), step)
        except FileNotFoundError:
            if self._taken_by_another(step, wait=True):
                return
            raise
        self.report.quarantined += [f"step {step}: {e} (moved to {where})", *shared]

    def _wait_for_markers(self, step: int, attempt: str | None, alive: Callable[[], bool]) -> list[Marker]:
        staged = self.layout.staged_step(step)

        def markers() -> list[Marker | None]:
            return step_markers(staged, step, staged_world(staged, step, self.policy.world_size))

        def missing() -> str:
            return f"step {step}: {describe_incomplete(markers(), attempt)} in {staged} (rank_<K>.done.json)"

        return wait_until(
            lambda: complete_markers(markers(), attempt),
            deadline_s=self.policy.marker_deadline_s,
            what=missing,
            alive=alive,
        )

    def commit(self, step: int, markers: list[Marker]) -> str:
        """Verify ``step``'s staged files against its markers and the format's own metadata, write the manifest,
        publish the step, then move ``latest``; returns the manifest's hash."""
        layout = self.layout
        staged = layout.staged_step(step)
        manifest = verified_manifest(step, markers, staged, layout.run_id, self.policy.allow_pickle)
        self.fence()
        try:
            manifest_hash = write_manifest(staged, manifest)
            inject("verify.before_publish", step=step)
            self.storage.publish(staged, layout.committed_step(step))
        except (OSError, PipelineError) as e:
            # Another committer published this step first? The same attempt, so the same manifest bytes. An I/O
            # error (EIO, ENOSPC: a failed fsync) fails the commit even then: it is never retried into success.
            raced = isinstance(e, OSError) and e.errno in RACES or type(e) is PipelineError
            if not raced or not self._taken_by_another(step, wait=True):
                raise
            try:
                return hash_file(layout.committed_step(step) / MANIFEST)
            except OSError:
                return ""  # published, then retired by its committer's retention: latest is past it
        inject("verify.before_latest", step=step)
        self.fence()
        self._move_latest(step, manifest_hash)
        log.info("committed step %d (%d files) -> %s", step, len(manifest.files), layout.committed_step(step))
        return manifest_hash
