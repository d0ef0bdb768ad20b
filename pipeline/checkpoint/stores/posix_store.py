"""Checkpoints in a POSIX directory (local disk, NFS, Lustre, GPFS, a FUSE mount): the protocol's store.

Inputs: ``checkpoints/staging/step_N/`` with each rank's files and ``rank_K.done.json``.
Outputs: ``checkpoints/step_N/``, the staged dir moved into place in one rename, then committed by its
``manifest.json`` written last (a function of the staged attempt, so two committers write the same bytes);
``checkpoints/latest`` replaced by rename; a refused step moved to ``checkpoints/quarantine/`` with its reason;
retention's steps moved into ``checkpoints/.deleting/`` in one rename, deleted later (:mod:`.trash`).
Owner: the one committer (:class:`~pipeline.checkpoint.protocol.committer.Committer`); every mutation goes through
:class:`~pipeline.storage.backend.Storage` (temp file, fsync, rename; never following a link).

No shared filesystem gives exclusion across nodes, so a duplicate committer (an operator's second one, a ghost
that a partition froze past its lease) can act once more before its fence stops it. This store copes with what
such an act leaves:

* a staged step that vanished, or a publish that failed with a race's errno, while the step is (or soon shows
  as) published: the other's publish, accepted (:meth:`PosixCheckpoints.taken_by_another`); a late publish of
  a step saved again since: no manifest (:func:`~pipeline.checkpoint.protocol.step_checks.not_as_verified`);
* ``latest`` never moved below a newer published step (readers check it against the newest published manifest);
* a complete staged step at or below ``latest`` left unpublished, or a step moved into place without its
  manifest (a commit interrupted between its two acts): verified and committed;
* a ``latest`` whose step's manifest this mount does not show yet (another mount's commit, half visible through
  this mount's cache): looked at again before it counts as damage (:meth:`PosixCheckpoints.newest`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.checkpoint.manifest import (
    MANIFEST,
    Latest,
    Manifest,
    Marker,
    Metrics,
    marker_path,
    read_latest,
    read_manifest,
    read_newest,
    staged_world,
    step_markers,
    verify_committed,
    write_latest,
    write_manifest,
    write_marker,
)
from pipeline.checkpoint.protocol import trash
from pipeline.checkpoint.protocol.lease_records import newest_holder
from pipeline.checkpoint.protocol.ownership import LEASE, CommitterBusy, FileLease, LeaseStore
from pipeline.checkpoint.protocol.step_checks import not_as_verified, verified_manifest
from pipeline.checkpoint.stores import posix_status, repair
from pipeline.checkpoint.stores.repair import step_entries
from pipeline.checkpoint.stores.store import ANY, RACES, Quarantined, Taken
from pipeline.errors import PipelineError, VerificationError
from pipeline.storage.atomic import clear_file
from pipeline.storage.backend import POSIX, Storage
from pipeline.storage.faults import inject
from pipeline.storage.integrity import hash_file, is_real_dir, lstat_kind
from pipeline.storage.layout import CheckpointLayout

if TYPE_CHECKING:
    from pipeline.formats.dcp_pieces import Pieces

log = logging.getLogger(__name__)

VISIBILITY_S = 5.0
"""How long a rename by another node may take to show through this node's mount (measured: ~10-20 ms)."""


def _bytes_hash(path: Path) -> str | None:
    """The hash of a small file's bytes (a record), or None when it is not a regular file."""
    try:
        return hash_file(path) if lstat_kind(path) == "file" else None
    except OSError:
        return None


def latest_step(layout: CheckpointLayout) -> int:
    """The newest committed step (0: none): ``latest``, or a newer published step when ``latest`` lags."""
    latest = read_newest(layout)
    return latest.step if latest else 0


class PosixCheckpoints:
    """The checkpoints dir of ``layout``."""

    def __init__(self, layout: CheckpointLayout, storage: Storage = POSIX) -> None:
        self.layout = layout
        self.storage = storage
        self._first_seen: dict[str, float] = {}  # trash entries -> when this committer first saw them (monotonic)

    @property
    def where(self) -> str:
        return str(self.layout.checkpoints)

    def scratch(self) -> Path:
        return self.layout.checkpoints

    # -- ownership ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        self.storage.makedirs(self.layout.checkpoints)
        with self.storage.exclusive(self.layout.committer_lock) as mine:  # one node: the kernel's lock, fast
            if not mine:
                try:  # who holds it, for the message only: a record that cannot be read names nobody
                    held = newest_holder(self.lease_store())
                except (OSError, PipelineError):
                    held = None
                who = f" ({held.describe(time.time())})" if held is not None else ""
                raise CommitterBusy(
                    f"another committer holds {self.layout.committer_lock}{who}: exactly one commits "
                    f"{self.layout.checkpoints} (stop the other one, or let it finish)"
                )
            yield

    def lease_store(self) -> LeaseStore:
        return FileLease(self.layout.checkpoints / LEASE)

    # -- latest ---------------------------------------------------------------------------------------------

    def read_latest(self) -> Latest | None:
        return read_latest(self.layout)

    def latest_named(self) -> int | None:
        return repair.latest_step_name(self.layout)

    def latest_epoch(self) -> int | None:
        return repair.latest_epoch(self.layout)

    def newest(self) -> Latest | None:
        """What a reader resumes from (:func:`read_newest`). A ``latest`` naming a step whose manifest this mount
        does not show whole yet (another mount's commit, half visible through this mount's cache) is looked at
        again for up to :data:`VISIBILITY_S`; a manifest read the same twice that still differs is damage."""
        deadline = time.monotonic() + VISIBILITY_S
        last: bytes | None = None
        while True:
            try:
                return read_newest(self.layout)
            except VerificationError:
                named = repair.latest_step_name(self.layout)
                final = self.layout.committed_step(named) if named is not None else None
                if final is None or self.storage.kind(final) != "dir" or time.monotonic() >= deadline:
                    raise
                if self.storage.kind(final / MANIFEST) is not None:
                    now = repair.read_or_none(final / MANIFEST)
                    if now is not None and now == last:
                        raise  # read the same twice: not a replace in flight
                    last = now
                time.sleep(0.05)

    def latest_version(self) -> str | None:
        return _bytes_hash(self.layout.latest)

    def move_latest(
        self, step: int, manifest_hash: str, epoch: int | None, *, back: bool = False, expect: str | None = ANY
    ) -> None:
        if not back:
            try:
                newest = read_newest(self.layout)
            except VerificationError:
                newest = None  # a damaged latest: this commit replaces it
            if newest is not None and newest.step > step:
                log.warning("step %d is newer (another committer's): latest is not moved back to %d", newest.step, step)
                return
        elif expect is not ANY and self.latest_version() != expect:
            log.warning("latest changed since it was found damaged (another committer repaired it): not moved to %d",
                        step)  # fmt: skip
            return
        write_latest(self.layout, step, manifest_hash, epoch=epoch)

    def drop_latest(self, problem: str) -> str:
        return str(repair.quarantine(self.storage, self.layout, self.layout.latest, problem))

    def remove_latest(self, expect: str | None = ANY) -> None:
        if expect is not ANY and self.latest_version() != expect:
            return  # moved by another committer since it was found damaged: theirs
        if self.storage.kind(self.layout.latest) is not None:
            self.storage.delete_file(self.layout.latest)

    # -- committed steps ------------------------------------------------------------------------------------

    def committed(self) -> list[int]:
        kind = self.storage.kind
        return [s for s, p in step_entries(self.storage, self.layout.checkpoints)
                if kind(p) == "dir" and kind(p / MANIFEST) == "file"]  # fmt: skip

    def is_published(self, step: int) -> bool:
        return self.storage.kind(self.layout.committed_step(step)) is not None

    def committed_attempt(self, step: int) -> str | None:
        return repair.committed_attempt(self.layout, step)

    def manifest_hash(self, step: int) -> str | None:
        return _bytes_hash(self.layout.committed_step(step) / MANIFEST)

    def verify_committed(self, step: int) -> str:
        path = self.layout.committed_step(step)
        verify_committed(path, step)
        return hash_file(path / MANIFEST)

    def step_metrics(self, step: int) -> Metrics:
        try:
            return read_manifest(self.layout.committed_step(step)).metrics
        except (PipelineError, OSError):
            return {}

    def stray(self) -> list[str]:
        return [str(p) for p in repair.planted(self.storage, self.layout)]

    def unfinished(self) -> list[int]:
        return [s for s, _ in repair.unmanifested(self.storage, self.layout)]

    def finishing(self, world_size: int) -> list[int]:
        return repair.finishing(self.storage, self.layout, world_size)

    # -- staged steps ---------------------------------------------------------------------------------------

    def staged(self) -> list[int]:
        return [s for s, _ in step_entries(self.storage, self.layout.staging)]

    def attempts(self, step: int) -> list[str | None]:
        return [None] if self.storage.kind(self.layout.staged_step(step)) == "dir" else []

    def markers(self, step: int, attempt: str | None, world_size: int) -> list[Marker | None]:
        staged = self.layout.staged_step(step)
        return step_markers(staged, step, staged_world(staged, step, world_size))

    def staged_where(self, step: int) -> str:
        return str(self.layout.staged_step(step))

    def verify_staged(self, step: int, markers: list[Marker], allow_pickle: bool) -> Manifest:
        return verified_manifest(step, markers, self.layout.staged_step(step), self.layout.run_id, allow_pickle)

    def publish(self, manifest: Manifest) -> str | None:
        """Move the staged step into place, then commit it by writing its manifest there: the commit is a file
        written last, as in a bucket. No committer writes into a directory that another may be renaming (a
        FUSE mount can lose an entry written into a directory another mount renames): the rename moves only
        the ranks' finished files, and a step published without its manifest is no committed step to any reader
        (a crash between the two: the next pass verifies it and writes the manifest, :meth:`tidy`). Two committers
        write the same manifest bytes (a function of the staged attempt)."""
        step = manifest.step
        staged, final = self.layout.staged_step(step), self.layout.committed_step(step)
        try:
            inject("verify.before_publish", step=step)
            self.storage.publish(staged, final)
            inject("verify.before_manifest", step=step)
            if why := not_as_verified(final, manifest):  # the act bound to what was verified: else no manifest
                raise Taken(f"step {step}: {why}; its manifest is not written, the next pass verifies what it holds")
            manifest_hash = write_manifest(final, manifest)
        except (OSError, PipelineError) as e:  # a Taken is no race: raised
            # Another committer published this step first? The same attempt, so the same manifest bytes. An I/O
            # error (EIO, ENOSPC: a failed fsync) fails the commit even then: it is never retried into success.
            raced = isinstance(e, OSError) and e.errno in RACES or type(e) is PipelineError
            if not raced or not self.taken_by_another(step, wait=True):
                raise
            return None
        return manifest_hash

    def taken_by_another(self, step: int, wait: bool) -> bool:
        staged, final = self.layout.staged_step(step), self.layout.committed_step(step) / MANIFEST
        deadline = time.monotonic() + (VISIBILITY_S if wait else 0.0)
        while True:
            named = repair.latest_step_name(self.layout)
            if self.storage.kind(final) == "file" or (named is not None and named >= step and wait):
                log.warning("step %d was published by another committer while this one checked it: left to it", step)
                return True
            if time.monotonic() >= deadline:
                if wait and self.storage.kind(staged) is None:
                    log.warning("step %d left staging under this committer (another committer moved it)", step)
                    return True
                return False
            time.sleep(0.02)

    def raced(self, step: int) -> bool:
        """Another committer is visibly at work on ``step`` (its staged dir gone, or a published one): give its
        rename the time to show, then accept it."""
        interfered = self.storage.kind(self.layout.staged_step(step)) is None or self.is_published(step)
        return self.taken_by_another(step, wait=interfered)

    def holes(self, upto: int) -> list[int]:
        """Staged steps at or below ``upto`` that are not published: a publish that two committers raced and
        neither completed (seen on a FUSE mount). Committing one is harmless: ``latest`` does not move back."""
        return [s for s in self.staged() if s <= upto and not self.is_published(s)]

    # -- damage, litter, retention --------------------------------------------------------------------------

    def quarantine(
        self, step: int, attempt: str | None, reason: str, committed: bool, manifest_hash: str | None = None
    ) -> Quarantined | None:
        path = self.layout.committed_step(step) if committed else self.layout.staged_step(step)
        if manifest_hash is not None and self.manifest_hash(step) != manifest_hash:
            log.warning("step %d is not the one found bad (committed again since): not quarantined", step)
            return None
        where, others = repair.quarantine_damage(self.storage, self.layout, path, reason, step)
        found = _bytes_hash(where / MANIFEST)
        if manifest_hash is not None and found != manifest_hash:
            # moved by a late act after another committer committed the step again: it goes back where it was, or,
            # where that cannot be (its path taken meanwhile), stays with a note saying it is good (issue 48 (e))
            why = f"its manifest hashes to {found}, the copy found bad's to {manifest_hash}"
            repair.move_back(self.storage, where, path, step, why)
            return None
        return Quarantined(str(where), others)

    def trashed(self) -> list[int]:
        return trash.trashed(self.layout)

    def restore(self, step: int) -> bool:
        return trash.restore(self.layout, step)

    def tidy(self, fence: Callable[[], None], world_size: int, allow_pickle: bool, first: bool) -> list[str]:
        repairs: list[str] = []
        if first:
            fence()  # a temp file may be a live holder's write in flight: only the holder sweeps
            repair.sweep_temp_files(self.storage, self.layout)
            for _, path in step_entries(self.storage, self.layout.checkpoints):  # a manifest's, left by a crash
                if self.storage.kind(path) == "dir":
                    repair.sweep_temp_files_in(self.storage, path)
            for path in repair.planted(self.storage, self.layout):
                kind = self.storage.kind(path)
                fence()
                where = repair.quarantine(
                    self.storage, self.layout, path, f"{path} is a {kind}, not a step directory; never followed"
                )
                repairs.append(f"{path} was a {self.storage.kind(where)}, not a step directory (moved to {where})")
        repair.finish_unmanifested(self.storage, self.layout, fence, world_size, allow_pickle)
        return repairs

    def claim(self, fence: Callable[[], None], epoch: int) -> None:
        fence()
        trash.claim(self.layout, epoch)

    def retire(self, steps: tuple[int, ...], fence: Callable[[], None], epoch: int) -> None:
        """Each step into the trash, re-checked at the act (:mod:`pipeline.checkpoint.protocol.trash`); then the trash
        entries this committer may delete now."""
        if not is_real_dir(self.layout.checkpoints):  # missing, or a link planted for it: nothing is touched
            return
        trash.purge(self.layout, epoch, self._first_seen)  # first: a link planted as the trash is unlinked
        moved = []
        for step in steps:
            fence()
            if trash.retire_step(self.layout, step, epoch):
                moved.append(step)
        if moved:
            log.info("retention: removing %s from %s", tuple(moved), self.layout.checkpoints)
            inject("retention.before_delete", area="checkpoints", steps=",".join(map(str, moved)))
        fence()
        trash.purge(self.layout, epoch, self._first_seen)

    # -- a rank ---------------------------------------------------------------------------------------------

    def rank_dir(self, step: int, rank: int) -> Path:
        staged = self.layout.staged_step(step)
        inject("shard_save.staging_dir", rank=rank, step=step, path=staged)
        staged.mkdir(parents=True, exist_ok=True)  # idempotent mkdir of a planned dir: safe from every rank
        clear_file(marker_path(staged, rank))  # our own stale marker from an older attempt, if any
        return staged

    def piece_source(self, rank: int, staged: Path, groups: Mapping[str, str]) -> Pieces:
        from pipeline.checkpoint.save import pieces  # noqa: PLC0415 - a rank's (torch); a committer never loads it

        return pieces.posix_source(self.layout, rank, staged, groups)

    def deliver(self, staged: Path, marker: Marker, reused: frozenset[str] = frozenset()) -> None:
        from pipeline.checkpoint.save import pieces  # noqa: PLC0415 - a rank's (torch); a committer never loads it

        write_marker(staged, marker)
        pieces.remember(self.layout, marker.rank, marker.step, marker.files)

    def release(self, staged: Path) -> None:  # nothing: the staged step is the checkpoint's own
        pass

    @property
    def poll_s(self) -> float:
        return 0.2

    # -- readers ----------------------------------------------------------------------------------------

    def check(self) -> None:
        """Nothing to ask a directory before a launch: ``prepare_dirs`` makes it."""

    def local(self, step: int | None = None) -> CheckpointLayout:
        return self.layout

    def latest_where(self) -> str:
        return str(self.layout.latest)

    def manifest_where(self, step: int) -> str:
        return str(self.layout.committed_step(step) / MANIFEST)

    def describe(self, world_size: int | None) -> dict[str, Any]:
        return posix_status.describe(self.layout, world_size)

    def sweep(self, latest: int, world_size: int) -> None:
        """Nothing: a staged step left below ``latest`` is a hole a raced publish left, or a record of an attempt
        that lost; it costs disk only, and ``status`` shows it."""
