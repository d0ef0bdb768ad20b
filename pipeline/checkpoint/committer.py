"""The one committer: verifies staged steps, publishes them, and only then moves ``latest``.

Inputs: ``checkpoints/staging/step_N/`` with each rank's ``rank_K.done.json``.
Outputs: ``checkpoints/step_N/manifest.json`` and the step published in one act (POSIX: a directory rename),
then ``checkpoints/latest`` replaced atomically; steps whose files fail their marker's size or hash move to
``checkpoints/quarantine/`` (never deleted) and the error names the file; retention after each commit.

The same :class:`Committer` runs in the app's verify-manifest job, in a ``torchrun`` script's rank 0 (a
background thread of :class:`~pipeline.checkpoint.Checkpointer`), and in ``python -m pipeline.commit``. Exactly
one runs at a time per checkpoint dir: :meth:`Committer.hold` takes the store's exclusive lock (``flock``), and
publishing is one indivisible act besides, so of two committers racing for a step exactly one publishes.

Every :meth:`Committer.recover` first re-verifies the step ``latest`` names: damage there (a changed or missing
file, a manifest that is not the one ``latest`` recorded, garbage in ``latest`` itself) is quarantined and
``latest`` goes back to the newest committed step that verifies. Nothing is followed through a symlink.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.checkpoint import repair, retention
from pipeline.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    Marker,
    complete_markers,
    describe_incomplete,
    marker_path,
    read_latest,
    staged_world,
    step_markers,
    verify_committed,
    write_latest,
    write_manifest,
)
from pipeline.checkpoint.repair import step_entries
from pipeline.errors import DeadlineError, PipelineError, VerificationError, plural
from pipeline.formats.registry import FORMATS, Format
from pipeline.storage.backend import POSIX, Storage
from pipeline.storage.faults import inject
from pipeline.storage.integrity import FileEntry, hash_file, verify_entries
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


@dataclass
class CommitReport:
    """What one committer run did: committed steps (with the unix time of each commit), and what it refused."""

    committed: dict[int, float] = field(default_factory=dict)
    quarantined: list[str] = field(default_factory=list)
    incomplete: list[tuple[int, str]] = field(default_factory=list)


class CommitterBusy(PipelineError):
    """Another committer holds these checkpoints."""


def latest_step(layout: CheckpointLayout) -> int:
    latest = read_latest(layout)
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


class Committer:
    """Commits the staged steps of one checkpoint dir. Not thread-safe: one thread drives it."""

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

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Be the one committer of these checkpoints for the block, or raise :class:`CommitterBusy`."""
        self.storage.makedirs(self.layout.checkpoints)
        with self.storage.exclusive(self.layout.committer_lock) as mine:
            if not mine:
                raise CommitterBusy(
                    f"another committer holds {self.layout.committer_lock}: exactly one commits "
                    f"{self.layout.checkpoints} (stop the other one, or let it finish)"
                )
            yield

    # -- the passes --------------------------------------------------------------------------------------------

    def recover(self) -> None:
        """What a committer does first: remove its own litter, re-verify ``latest`` (quarantining damage), and
        finish a commit that was interrupted between publishing a step and moving ``latest``."""
        repair.sweep_temp_files(self.storage, self.layout)
        self.report.quarantined += repair.recheck_latest(self.storage, self.layout)
        after = latest_step(self.layout)
        for step, path in step_entries(self.storage, self.layout.checkpoints):
            if step <= after or self.storage.kind(path) != "dir" or self.storage.kind(path / MANIFEST) != "file":
                continue
            verify_committed(path, step)
            write_latest(self.layout, step, hash_file(path / MANIFEST))
            log.warning("step %d was published but latest was not moved (interrupted commit): latest -> %d", step, step)
            self.report.committed[step] = time.time()

    def commit_ready(self) -> list[int]:
        """One look: commit every staged step newer than ``latest`` whose markers are all there (one attempt)
        and whose files verify; quarantine one that does not. Steps still incomplete are left for later."""
        done = []
        for step in self._candidates():
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
        return done

    def follow(self, alive: Callable[[], bool], stop: Callable[[], bool] = lambda: False) -> None:
        """Commit each step as soon as it is complete while the producer is ``alive()`` (and ``stop()`` is not
        set); returns after one more look once it is not."""
        while True:
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
            self._quarantine_step(step, e)
            return False
        self.report.committed[step] = time.time()
        retention.apply(self.layout, self.policy, latest_step=latest_step(self.layout) or None)
        return True

    def _quarantine_step(self, step: int, e: Exception) -> None:
        where = repair.quarantine(self.storage, self.layout, self.layout.staged_step(step), str(e), step)
        self.report.quarantined.append(f"step {step}: {e} (moved to {where})")

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
        fmt, files = check_agreement(step, markers, str(staged))
        _verify_marked(staged, markers, fmt)
        check_stored(fmt, staged, step, markers, self.policy.allow_pickle)
        manifest = Manifest(
            step=step,
            world_size=markers[0].world_size,
            format=markers[0].format,
            attempt=markers[0].attempt,
            run_id=layout.run_id,
            files=files,
        )
        manifest_hash = write_manifest(staged, manifest)
        inject("verify.before_publish", step=step)
        self.storage.publish(staged, layout.committed_step(step))
        inject("verify.before_latest", step=step)
        write_latest(layout, step, manifest_hash)
        log.info("committed step %d (%d files) -> %s", step, len(files), layout.committed_step(step))
        return manifest_hash


def check_agreement(step: int, markers: list[Marker], where: str) -> tuple[Format, tuple[FileEntry, ...]]:
    """The markers of one step agree (one world size, as many markers, one attempt, one known format) and no
    file is claimed twice: the step's format and every file the markers list."""
    world = {m.world_size for m in markers}
    attempts = {m.attempt for m in markers}
    if len(world) != 1 or len(markers) not in world or len(attempts) != 1:
        raise VerificationError(
            f"markers of step {step} in {where} disagree: {len(markers)} markers, world sizes {sorted(world)}, "
            f"attempts {sorted(attempts)}"
        )
    formats = {m.format for m in markers}
    if len(formats) != 1 or not formats <= FORMATS.keys():
        raise VerificationError(
            f"markers of step {step} in {where} name format(s) {sorted(formats)}; known: {sorted(FORMATS)}"
        )
    files = tuple(f for m in markers for f in m.files)
    dupes = sorted(p for p, n in Counter(f.path for f in files).items() if n > 1)
    if dupes:
        raise VerificationError(
            f"markers of step {step} in {where} claim the same file(s) {dupes}: files are rank-private"
        )
    return FORMATS[markers[0].format], files


def check_stored(fmt: Format, step_dir: Path, step: int, markers: list[Marker], allow_pickle: bool) -> None:
    """The format's own metadata (verified bytes by now) names every file holding data, and how many ranks wrote
    them (read once: a DCP step's ranks follow from its file names): all listed, by the markers' world size."""
    paths = {f.path for m in markers for f in m.files}
    stored = fmt.stored_files(step_dir, allow_pickle)
    unlisted = sorted(stored - paths)
    if unlisted:
        raise VerificationError(
            f"step {step} in {step_dir}: {unlisted} hold checkpoint data but no marker lists them (a marker that "
            "lists fewer files than its rank wrote)"
        )
    written_by = fmt.world_size_of(step_dir, stored, allow_pickle)
    if written_by != markers[0].world_size:
        raise VerificationError(
            f"step {step} in {step_dir}: the {fmt.name} files were written by {plural(written_by, 'rank')}, the "
            f"markers say {markers[0].world_size}"
        )


def foreign_files(markers: list[Marker], fmt: Format) -> tuple[Marker, list[str]] | None:
    """The first marker that lists a file its format names as another rank's, with those files."""
    for m in markers:
        foreign = [f.path for f in m.files if fmt.owner(f.path) not in (None, m.rank)]
        if foreign:
            return m, foreign
    return None


def _verify_marked(staged: Path, markers: list[Marker], fmt: Format) -> None:
    """Each marker lists only files its rank owns, and every listed file has the size and hash it records.

    Marker by marker, the first problem wins, as if each marker were checked in turn (owners, then its files);
    the files are hashed together, several at once, up to the first marker that lists another rank's file.
    """
    entries: list[FileEntry] = []
    listed_in: list[str] = []
    for m in markers:
        foreign = [f.path for f in m.files if fmt.owner(f.path) not in (None, m.rank)]
        if foreign:
            verify_entries(staged, entries, listed_in)  # the markers before it come first
            raise VerificationError(
                f"{marker_path(staged, m.rank)} lists {foreign}, which {fmt.name} names as another rank's "
                "files: each rank lists only the files it owns"
            )
        entries.extend(m.files)
        listed_in.extend([str(marker_path(staged, m.rank))] * len(m.files))
    verify_entries(staged, entries, listed_in)
