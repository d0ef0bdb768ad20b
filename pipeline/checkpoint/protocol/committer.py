"""The one committer: verifies staged steps, publishes them, and only then moves ``latest``.

Inputs: a step's staged files and each rank's ``rank_K.done.json`` in its store
(:mod:`pipeline.checkpoint.stores.store`).
Outputs: the step published with its manifest (the commit point), then ``latest`` moved; a step whose files fail
their marker's size or hash goes to quarantine (never deleted) and the error names the file; retention after
each commit.

The same :class:`Committer` runs in the app's verify-manifest job, in a ``torchrun`` script's rank 0 (a
background thread of :class:`~pipeline.checkpoint.Checkpointer`), and in ``python -m pipeline.commit``, over
either store: it is written once, above :class:`~pipeline.checkpoint.stores.store.CheckpointStore`. Exactly one
commits a checkpoints root at a time: :meth:`Committer.hold` takes the committer lease (a record with a fencing
epoch and a heartbeat, :mod:`pipeline.checkpoint.protocol.ownership`; ``flock`` only as a fast path on one node), and
checks it before every act that changes the checkpoints.

No shared filesystem gives exclusion across nodes, so a second committer (an operator's, or a ghost back from a
partition) can still act once between its last check and its act; every such act is harmless (the stores say
how: :mod:`pipeline.checkpoint.stores.posix_store`, :mod:`pipeline.checkpoint.stores.bucket_store`).

Every :meth:`Committer.recover` first re-verifies the step ``latest`` names: damage there (a changed or missing
file, a manifest that is not the one ``latest`` recorded, garbage in ``latest`` itself) is quarantined and
``latest`` goes back to the newest committed step that verifies. A damaged piece that several steps hold (an
incremental save's) takes every committed step holding it to quarantine. Nothing is followed through a symlink.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from pipeline.checkpoint.manifest import Marker, complete_markers, describe_incomplete
from pipeline.checkpoint.protocol import retention
from pipeline.checkpoint.protocol.latest_repair import LatestRepair
from pipeline.checkpoint.protocol.ownership import CommitterBusy, CommitterLease, CommitterLost
from pipeline.checkpoint.protocol.policy import CommitPolicy, CommitReport
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints, latest_step
from pipeline.checkpoint.stores.store import RACES, CheckpointStore, Taken
from pipeline.errors import DeadlineError, PipelineError, ReadFailed, VerificationError
from pipeline.storage.faults import inject
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.reads import unknown
from pipeline.storage.waiting import wait_until

log = logging.getLogger(__name__)

OUTAGE_S = 600.0
"""How long a following committer's passes may keep failing to read or write the store (a filer away, a stale
NFS handle) before it stops with one line; each failed pass takes no act and the next one starts with
:meth:`Committer.recover` again."""


__all__ = [
    "CommitPolicy",
    "CommitReport",
    "Committer",
    "CommitterBusy",
    "CommitterLost",
    "latest_step",
]


class Committer(LatestRepair):
    """Commits the staged steps of one checkpoints root. Not thread-safe: one thread drives it."""

    def __init__(
        self,
        layout: CheckpointLayout,
        policy: CommitPolicy,
        store: CheckpointStore | None = None,
        save_errors: Callable[[], dict[int, str]] = dict,
    ) -> None:
        """``store``: where the checkpoints are (default: ``layout``'s directory). ``save_errors()``: why the
        producer could not save a step, when it says (named beside a missing marker)."""
        self.layout = layout
        self.policy = policy
        self.store: CheckpointStore = store if store is not None else PosixCheckpoints(layout)
        self.save_errors = save_errors
        self.report = CommitReport()
        self.lease: CommitterLease | None = None
        self.recovered = False
        """Whether :meth:`recover` completed since the last pass that failed on I/O (else the next pass runs it)."""
        self._outage: tuple[float, str] | None = None  # (since, first error) while passes fail on I/O
        self._unread_since: dict[int, float] = {}  # steps not committed for a failed read -> first failure

    @contextlib.contextmanager
    def hold(self, takeover: bool = False) -> Iterator[None]:
        """Be the one committer of these checkpoints for the block, or raise :class:`CommitterBusy` naming the
        live holder. ``takeover``: this process was made the owner by the scheduler or the training job (the
        run's committer job, rank 0 of a process group), so a live holder is fenced off rather than obeyed."""
        with self.store.opened():
            lease = CommitterLease(self.store.lease_store(), self.policy.lease_s)
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

    def _tidy_args(self) -> tuple[int, bool]:
        return self.policy.world_size, self.policy.allow_pickle

    @property
    def epoch(self) -> int | None:
        return self.lease.epoch if self.lease is not None else None

    # -- the passes --------------------------------------------------------------------------------------------

    def recover(self) -> None:
        """What a committer does first: remove its own litter, re-verify ``latest`` (quarantining damage), and
        finish a commit that was interrupted between publishing a step and moving ``latest``."""
        self.recovered = False
        if self.epoch is not None:  # first: what its predecessors retired is this holder's before any repair
            self.store.claim(self.fence, self.epoch)
        self.report.quarantined += self.store.tidy(self.fence, *self._tidy_args(), first=True)
        self.report.quarantined += self.recheck_latest()
        after = self._pointer_step()
        for step in self.store.committed():
            if step <= after:
                continue
            found = self.store.manifest_hash(step)
            try:
                manifest_hash = self.store.verify_committed(step)
            except VerificationError as e:  # published, then damaged: never left above latest to fail every start
                self._quarantine(step, None, str(e), committed=True, manifest_hash=found)
                after = self._pointer_step()
                continue
            self.fence()
            self.store.move_latest(step, manifest_hash, self.epoch)
            log.warning("step %d was published but latest was not moved (interrupted commit): latest -> %d", step, step)
            self.report.committed[step] = time.time()
        self.recovered = True

    def recover_or_defer(self) -> bool:
        """:meth:`recover`; where the store cannot be read or written now (a filer away), one line and False:
        :meth:`follow` runs it again before its next pass. Never an act because a read failed."""
        try:
            self.recover()
        except (ReadFailed, OSError) as e:
            if not unknown(e):
                raise
            self._failed_pass(e)
            return False
        return True

    def commit_ready(self) -> list[int]:
        """One look: commit every staged step newer than ``latest`` whose markers are all there (one attempt)
        and whose files verify; quarantine one that does not. Steps still incomplete are left for later."""
        done = []
        self.report.quarantined += self.store.tidy(self.fence, *self._tidy_args(), first=False)
        try:
            self.store.read_latest()
        except VerificationError:  # a damaged latest, or a stale committer's pointer to a step retired since
            self.report.quarantined += self.recheck_latest()
        for step in self._candidates() + self.store.holes(self.latest_step()):
            if self.store.is_published(step):
                continue
            self.report.unread.pop(step, None)  # judged again this pass
            for attempt in self.store.attempts(step):
                try:
                    markers = complete_markers(self.store.markers(step, attempt, self.policy.world_size), None)
                except VerificationError:
                    continue  # damaged markers: the last pass quarantines the step
                except ReadFailed as e:
                    log.warning("step %d: its markers cannot be read now, looked at again next pass: %s", step, e)
                    self._not_read(step, str(e))
                    continue
                if markers is not None and self._commit_or_quarantine(step, markers):
                    done.append(step)
                    break
            if self._waits_for(step):  # in order: latest never moves past a step no one could read yet, so
                break  # nothing sweeps it as superseded (bounded by OUTAGE_S; simulation seed 1004575)
        self._catch_up_latest()
        return done

    def follow(self, alive: Callable[[], bool], stop: Callable[[], bool] = lambda: False) -> None:
        """Commit each step as soon as it is complete while the producer is ``alive()`` (and ``stop()`` is not
        set); returns after one more look once it is not."""
        while True:
            self.check_lost()
            try:
                running = alive() and not stop()
            except (ReadFailed, OSError) as e:  # whether the producer runs cannot be told now: it may
                if not unknown(e):
                    raise
                running = not stop()
            try:
                if not self.recovered:
                    self.recover()
                self.commit_ready()
            except (ReadFailed, OSError) as e:  # no act was taken on what could not be read
                if not unknown(e):
                    raise
                self._failed_pass(e)
                if not running:
                    raise
            else:
                self._pass_ok()
            if not running:
                return
            time.sleep(self.policy.poll_interval_s)

    def _not_read(self, step: int, why: str) -> None:
        self.report.unread[step] = why
        self._unread_since.setdefault(step, time.monotonic())

    def _waits_for(self, step: int) -> bool:
        """Whether newer steps wait for ``step``, not committed because it could not be read, for up to
        :data:`OUTAGE_S` (then it is passed over, as a step that never completed is)."""
        since = self._unread_since.get(step)
        return step in self.report.unread and since is not None and time.monotonic() - since < OUTAGE_S

    def _failed_pass(self, e: Exception) -> None:
        """A pass that could not read or write the store: one line when an outage starts, then quiet; past
        :data:`OUTAGE_S` the committer stops, in one line. The next pass recovers first."""
        self.recovered = False
        now = time.monotonic()
        if self._outage is None:
            self._outage = (now, str(e))
            log.warning("committer: the store cannot be read or written now, trying again every %.1f s: %s",
                        self.policy.poll_interval_s, e)  # fmt: skip
        elif now - self._outage[0] > OUTAGE_S:
            raise PipelineError(
                f"committer: {self.store.where} could not be read or written for {now - self._outage[0]:.0f} s "
                f"(first: {self._outage[1]}; now: {e}); nothing was quarantined or rolled back for it: check the "
                "storage, then start the committer again"
            ) from e

    def _pass_ok(self) -> None:
        if self._outage is not None:
            log.warning("committer: the store answers again after %.0f s", time.monotonic() - self._outage[0])
            self._outage = None

    def finish(self, attempt: str | None, alive: Callable[[], bool]) -> None:
        """The last pass: each staged step newer than ``latest`` waits for its markers (deadline, liveness) and
        is committed or quarantined; steps that cannot complete are recorded in the report."""
        for step in self._candidates():
            if self.store.is_published(step):
                log.warning("step %d is staged again but already published; the staged copy is left alone", step)
                continue
            try:
                markers = self._wait_for_markers(step, attempt, alive)
            except DeadlineError as e:
                self.report.incomplete.append((step, str(e)))
                continue
            except ReadFailed as e:  # unknown, not damage: left staged for the next committer
                self.report.incomplete.append((step, f"step {step} is not committed: {e}"))
                continue
            except VerificationError as e:
                self._quarantine_staged(step, None, e)
                continue
            if not self._commit_or_quarantine(step, markers) and step in self.report.unread:
                self.report.incomplete.append((step, f"step {step} is not committed: {self.report.unread[step]}"))
        self.fence()  # a step left uncommitted because it could not be read is no leftover: nothing from it up goes
        upto = min([self.latest_step(), *(s - 1 for s in self.report.unread)])
        self.store.sweep(upto, self.policy.world_size)

    def latest_step(self) -> int:
        """The newest committed step (0: none): ``latest``, or a newer published step when ``latest`` lags."""
        newest = self.store.newest()
        return newest.step if newest else 0

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
        """``latest``'s step when it verifies, nothing newer is staged or published, no commit is half done and
        nothing is planted; else None (a committer has work to do)."""
        try:
            newest = self.store.read_latest()
            if newest is None or self._candidates() or self.store.stray() or self.store.unfinished():
                return None
            if any(s > newest.step for s in self.store.committed()):
                return None
            self.store.verify_committed(newest.step)
        except (VerificationError, OSError, ValueError, ReadFailed):
            return None
        return newest.step

    def pending(self) -> list[int]:
        """Staged steps newer than ``latest`` (complete or not): work a following committer still expects."""
        return self._candidates()

    # -- one step ----------------------------------------------------------------------------------------------

    def _candidates(self) -> list[int]:
        after = self.latest_step()
        return [s for s in self.store.staged() if s > after]

    def _commit_or_quarantine(self, step: int, markers: list[Marker]) -> bool:
        try:
            self.commit(step, markers)
        except VerificationError as e:
            self._quarantine_staged(step, markers[0].attempt, e)
            return False
        except ReadFailed as e:  # unknown, not damage: no act, the step is looked at again
            log.warning("step %d is not committed now (%s): looked at again next pass", step, e)
            self._not_read(step, str(e))
            return False
        except Taken as e:
            self.report.quarantined.append(f"step {step}: {e}")
            return False
        except OSError as e:  # the staged step vanished under the check: another committer's, or a real I/O error
            if e.errno not in RACES:
                raise
            if self.store.taken_by_another(step, wait=True):
                return False
            log.warning("step %d: %s (another committer at work on it?): looked at again next pass", step, e)
            return False
        self.report.committed[step] = time.time()
        self.report.unread.pop(step, None)
        self._unread_since.pop(step, None)
        self.apply_retention()
        return True

    def apply_retention(self) -> retention.Decision:
        """Retention after a commit: the committed steps the policy lets go (each re-checked at the act), and the
        outputs past their count."""
        self.fence()
        return retention.apply(
            self.store, self.policy, latest_step=self.latest_step() or None, fence=self.fence, epoch=self.epoch or 0
        )

    def _quarantine_staged(self, step: int, attempt: str | None, e: Exception) -> None:
        try:
            self._quarantine(step, attempt, str(e), committed=False)
        except FileNotFoundError:
            if self.store.taken_by_another(step, wait=True):
                return
            raise

    def _wait_for_markers(self, step: int, attempt: str | None, alive: Callable[[], bool]) -> list[Marker]:
        def look() -> list[Marker | None] | None:
            found = None
            for a in self.store.attempts(step):
                if attempt is not None and a is not None and a != attempt:
                    continue
                markers = self.store.markers(step, a, self.policy.world_size)
                if complete_markers(markers, attempt) is not None:
                    return markers
                found = markers
            return found

        def missing() -> str:
            got = look()
            said = describe_incomplete(got, attempt) if got is not None else "no rank wrote a marker"
            return f"step {step}: {said} in {self.store.staged_where(step)} (rank_<K>.done.json)"

        def complete() -> list[Marker] | None:
            got = look()
            return complete_markers(got, attempt) if got is not None else None

        return wait_until(complete, deadline_s=self.policy.marker_deadline_s, what=missing, alive=alive)

    def commit(self, step: int, markers: list[Marker]) -> str:
        """Verify ``step``'s staged files against its markers and the format's own metadata, publish the step
        with its manifest, then move ``latest``; returns the manifest's hash ("" when another committer
        published this step first: the same attempt, so the same manifest; ``latest`` is its to move)."""
        try:
            manifest = self.store.verify_staged(step, markers, self.policy.allow_pickle)
        except (VerificationError, FileNotFoundError):  # a file gone mid-read: moved by another's publish?
            if self.store.raced(step):  # another committer published it while this one read it: it is done
                return ""
            raise
        self.fence()
        manifest_hash = self.store.publish(manifest)
        if manifest_hash is None:  # another committer published this very attempt: latest is its to move
            return ""
        inject("verify.before_latest", step=step)
        self.fence()
        self.store.move_latest(step, manifest_hash, self.epoch)
        log.info("committed step %d (%d files) -> %s", step, len(manifest.files), self.store.where)
        return manifest_hash
