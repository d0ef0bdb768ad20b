"""What a pass of the committer does about another committer acting on the same checkpoints at the same time.

No shared filesystem gives exclusion across nodes, so a duplicate committer (an operator's second one, a ghost
that a partition froze past its lease) can act once more before its fence stops it. A pass of
:class:`~pipeline.checkpoint.committer.Committer` copes with whatever such an act leaves, through these methods:

* a staged step that vanished, or a publish that failed with a race's errno, while the step is (or soon shows
  as) published: the other's publish, accepted (:meth:`DuplicateTolerance._taken_by_another`);
* ``latest`` never moved below a newer published step, and moved up to it when it lags;
* a complete staged step at or below ``latest`` left unpublished, or a published step without its manifest (a
  directory rename of a FUSE filesystem raced by two mounts): verified and committed.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Protocol

from pipeline.checkpoint import repair
from pipeline.checkpoint.manifest import (
    MANIFEST,
    complete_markers,
    pointer_step,
    read_newest,
    staged_world,
    step_markers,
    verify_committed,
    write_latest,
    write_manifest,
)
from pipeline.checkpoint.ownership import CommitterLease
from pipeline.checkpoint.repair import step_entries
from pipeline.checkpoint.step_checks import verified_manifest
from pipeline.errors import VerificationError
from pipeline.storage.backend import Storage
from pipeline.storage.layout import CheckpointLayout

log = logging.getLogger(__name__)

RACES = (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST)
"""What a publish or a read meets when another committer moves the same step at the same moment."""
VISIBILITY_S = 5.0
"""How long a rename by another node may take to show through this node's mount (measured: ~10-20 ms)."""


class _Policy(Protocol):
    @property
    def world_size(self) -> int: ...
    @property
    def allow_pickle(self) -> bool: ...


class DuplicateTolerance:
    """Mixed into the committer: its state is the committer's."""

    layout: CheckpointLayout
    storage: Storage
    lease: CommitterLease | None
    policy: _Policy

    def fence(self) -> None:
        raise NotImplementedError

    def _finish_unmanifested(self) -> None:
        """A published step without its manifest: two committers' publishes raced on a filesystem whose directory
        rename is not atomic against writes inside it (seen on a FUSE mount). Verified, its manifest is written."""
        for step, path in step_entries(self.storage, self.layout.checkpoints):
            if self.storage.kind(path) != "dir" or self.storage.kind(path / MANIFEST) is not None:
                continue
            try:
                world = staged_world(path, step, self.policy.world_size)
                markers = complete_markers(step_markers(path, step, world), None)
                if markers is None:
                    continue
                manifest = verified_manifest(step, markers, path, self.layout.run_id, self.policy.allow_pickle)
            except (VerificationError, OSError) as e:
                log.warning("%s is published without a manifest and does not verify; not a committed step: %s", path, e)
                continue
            self.fence()
            write_manifest(path, manifest)
            log.warning(
                "step %d was published without its manifest (a raced publish): verified, manifest written", step
            )

    def _catch_up_latest(self) -> None:
        """``latest`` behind the newest published step (a stale committer elsewhere moved it back, or a commit
        was interrupted before moving it): verified, then ``latest`` moves up to it."""
        newest = read_newest(self.layout)
        if newest is None or newest.step <= pointer_step(self.layout):
            return
        try:
            verify_committed(self.layout.committed_step(newest.step), newest.step)
        except VerificationError as e:
            log.warning("step %d is published but does not verify; latest stays (the next start rechecks): %s",
                        newest.step, e)  # fmt: skip
            return
        log.warning("latest was behind published step %d: moved up to it", newest.step)
        self.fence()
        self._move_latest(newest.step, newest.manifest_hash)

    def _holes(self) -> list[int]:
        """Staged steps at or below ``latest`` that are not published: a publish that two committers raced and
        neither completed (seen on a FUSE mount). Committing one is harmless: ``latest`` does not move back."""
        newest = read_newest(self.layout)
        after = newest.step if newest else 0
        return [
            s
            for s, _ in step_entries(self.storage, self.layout.staging)
            if s <= after and self.storage.kind(self.layout.committed_step(s)) is None
        ]

    def _interfered(self, step: int) -> bool:
        """Whether another committer is visibly at work on ``step``: its staged dir gone, or a published one."""
        staged, final = self.layout.staged_step(step), self.layout.committed_step(step)
        return self.storage.kind(staged) is None or self.storage.kind(final) is not None

    def _taken_by_another(self, step: int, wait: bool) -> bool:
        """Whether another committer published ``step`` (or moved it out of staging) while this one checked it.
        ``wait``: give another node's rename up to :data:`VISIBILITY_S` to show through this node's mount."""
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

    def _move_latest(self, step: int, manifest_hash: str) -> None:
        """``latest`` -> ``step``, unless it already names a newer published step (another committer's)."""
        try:
            newest = read_newest(self.layout)
        except VerificationError:
            newest = None  # a damaged latest: this commit replaces it
        if newest is not None and newest.step > step:
            log.warning("step %d is newer (another committer's): latest is not moved back to %d", newest.step, step)
            return
        write_latest(self.layout, step, manifest_hash, epoch=self.lease.epoch if self.lease else None)
