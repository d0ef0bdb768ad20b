"""The one store interface of the checkpoint protocol: what the committer asks of wherever checkpoints live.

The protocol is written once, above this interface (:class:`~pipeline.checkpoint.protocol.committer.Committer`: its
passes, the repair of ``latest``, the fall back to the newest step that verifies, retention's decision, the verdict);
each store carries it out with its own strongest primitives:

* :class:`~pipeline.checkpoint.stores.posix_store.PosixCheckpoints`: a local or shared POSIX filesystem. Ranks stage
  into ``staging/step_N/``; a step is published by one directory rename; ``latest`` is replaced by rename; a
  shared piece is one inode hard-linked into every step holding it.
* :class:`~pipeline.checkpoint.stores.bucket_store.BucketCheckpoints`: an S3-compatible bucket. Ranks upload into
  ``step_N/<attempt>/``; a step is published by its manifest written with ``If-None-Match: *``; ``latest`` moves
  by compare-and-swap; a shared piece is one object ``pieces/<hash>``.

Exclusion never comes from the store's listing or locks alone: the committer lease (:mod:`.ownership`) lives in
the store (a record written by rename, or an object written by compare-and-swap) and every act below is harmless
when a stale committer performs it once more (publishing the same verified attempt twice, ``latest`` moved
forward only, retention of steps a fresher view would drop too).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.checkpoint.manifest import Latest, Manifest, Marker, Metrics
from pipeline.checkpoint.protocol.ownership import LeaseStore
from pipeline.errors import PipelineError
from pipeline.storage.layout import CheckpointLayout

if TYPE_CHECKING:  # a committer never loads torch
    from pipeline.formats.dcp_pieces import Pieces

ANY: Any = object()
"""``expect`` of a repair's move of ``latest``: from whatever it is now (else from the version given)."""

RACES = (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST)
"""What a publish or a read meets when another committer moves the same step at the same moment."""


class Taken(PipelineError):
    """The step was published meanwhile with another attempt's manifest (another committer's, or planted)."""


@dataclass
class Quarantined:
    """What one quarantine moved: where the step went, and the other committed steps that held one of its
    damaged shared pieces (moved too, one line each)."""

    where: str
    others: dict[int, str] = field(default_factory=dict)
    """Step -> a line saying which damaged piece took it to quarantine, and where it went."""


class CheckpointStore(Protocol):
    """One checkpoints root (a directory, or a bucket prefix), seen by its one committer."""

    layout: CheckpointLayout
    """The local checkpoints dir: the whole store (POSIX), or the bucket's local side (records, pulled copies)."""

    @property
    def where(self) -> str:
        """The root, as users name it (a path or an ``s3://`` URL)."""
        ...

    # -- ownership ------------------------------------------------------------------------------------------
    def opened(self) -> contextlib.AbstractContextManager[None]:
        """Held while committing: checks the store can do what the protocol needs (a bucket's conditional
        writes), and takes a local fast-path lock where one exists (raises CommitterBusy if held)."""
        ...

    def lease_store(self) -> LeaseStore: ...

    # -- latest ---------------------------------------------------------------------------------------------
    def read_latest(self) -> Latest | None:
        """``latest``, checked against its manifest's hash (VerificationError when malformed or stale)."""
        ...

    def latest_named(self) -> int | None:
        """The step a (possibly damaged) ``latest`` names; only to decide what to quarantine."""
        ...

    def latest_epoch(self) -> int | None:
        """The lease epoch of the committer that wrote ``latest`` (None: unknown)."""
        ...

    def newest(self) -> Latest | None:
        """What a reader resumes from: ``latest``, or a newer published step when ``latest`` lags."""
        ...

    def latest_version(self) -> str | None:
        """What ``latest`` is now, as a version to compare against (its bytes' hash, an ETag; None: absent)."""
        ...

    def move_latest(
        self, step: int, manifest_hash: str, epoch: int | None, *, back: bool = False, expect: str | None = ANY
    ) -> None:
        """``latest`` -> ``step``; never below a newer published step unless ``back`` (the repair of damage),
        which happens only while ``latest`` is still ``expect`` (the version read before the verification that
        justified it; a bucket swaps against it, a directory compares just before its rename)."""
        ...

    def drop_latest(self, problem: str) -> str:
        """Take a damaged ``latest`` away (kept aside where the store can); returns where it went."""
        ...

    def remove_latest(self, expect: str | None = ANY) -> None:
        """Remove ``latest`` (no committed step verifies), if there is one and it is still ``expect``."""
        ...

    # -- committed steps ------------------------------------------------------------------------------------
    def committed(self) -> list[int]:
        """Steps whose manifest exists (listing nominates; :meth:`verify_committed` decides)."""
        ...

    def is_published(self, step: int) -> bool:
        """Whether anything holds ``step``'s committed name (a published step, or something planted there)."""
        ...

    def committed_attempt(self, step: int) -> str | None:
        """The attempt ``step``'s committed manifest records: a complete staged attempt other than this one is a
        save of the step again after its committed copy was found bad, which a resume waits for (None: nothing
        committed; "": a manifest past reading)."""
        ...

    def manifest_hash(self, step: int) -> str | None:
        """The hash of committed ``step``'s manifest as it is now (None: none): what a quarantine names."""
        ...

    def verify_committed(self, step: int) -> str:
        """Re-read every file of committed ``step`` against its manifest; returns the manifest's hash."""
        ...

    def step_metrics(self, step: int) -> Metrics:
        """The metrics a committed step's manifest records (``{}`` when none, or when it cannot be read)."""
        ...

    def stray(self) -> list[str]:
        """Entries planted where steps go (links, files): the next pass quarantines them."""
        ...

    def unfinished(self) -> list[int]:
        """Steps moved into place whose manifest is not written yet (a commit interrupted between its two acts,
        on a store that has two): no committed step to a reader; the next pass verifies and finishes them."""
        ...

    def finishing(self, world_size: int) -> list[int]:
        """The :meth:`unfinished` steps that hold every rank's marker: a commit between its two acts, which a
        committer finishes once it verifies them. A resuming reader waits for them as for a staged step (it
        sees neither a staged step nor a committed one there)."""
        ...

    # -- staged steps ---------------------------------------------------------------------------------------
    def staged(self) -> list[int]:
        """Steps with staged files (any attempt), committed or not."""
        ...

    def attempts(self, step: int) -> list[str | None]:
        """The staged attempts of ``step`` (None: the one staged dir, whose markers name their attempt)."""
        ...

    def markers(self, step: int, attempt: str | None, world_size: int) -> list[Marker | None]: ...

    def staged_where(self, step: int) -> str: ...

    def verify_staged(self, step: int, markers: list[Marker], allow_pickle: bool) -> Manifest:
        """Check every staged file of ``step`` against its markers and its format; the manifest to publish."""
        ...

    def publish(self, manifest: Manifest) -> str | None:
        """The commit point. Returns the manifest's hash; None when another committer published the same step
        meanwhile (the same attempt: it moves ``latest``); :class:`Taken` when another attempt holds it."""
        ...

    def taken_by_another(self, step: int, wait: bool) -> bool:
        """Whether another committer published ``step`` (or moved it out of staging) while this one checked it;
        ``wait``: give another node's act the time it takes to show here."""
        ...

    def raced(self, step: int) -> bool:
        """After ``step`` failed verification: whether another committer's act on it explains the failure."""
        ...

    def holes(self, upto: int) -> list[int]:
        """Staged steps at or below ``upto`` left unpublished by a publish that two committers raced."""
        ...

    # -- damage, litter, retention --------------------------------------------------------------------------
    def quarantine(
        self, step: int, attempt: str | None, reason: str, committed: bool, manifest_hash: str | None = None
    ) -> Quarantined | None:
        """Move a step (its committed copy, or its staged ``attempt``; None: every staged attempt) aside with
        the reason, never deleted; and every committed step holding one of its damaged shared pieces.
        ``manifest_hash``: the committed copy found bad; another copy there now (committed again since) is left
        alone, and None is returned."""
        ...

    def tidy(self, fence: Callable[[], None], world_size: int, allow_pickle: bool, first: bool) -> list[str]:
        """Before a pass: finish a publish two committers raced; ``first`` (a committer's first pass): remove its
        own litter and quarantine what was planted. Returns a line per repair (``fence`` before any act)."""
        ...

    def claim(self, fence: Callable[[], None], epoch: int) -> None:
        """A new holder's first act, before any repair: the retired steps lower epochs left restorable become this
        holder's, where the store can make its predecessor's late purge of them find nothing (``fence`` first)."""
        ...

    def retire(self, steps: tuple[int, ...], fence: Callable[[], None], epoch: int) -> None:
        """Remove committed steps retention let go, each re-checked at the act (never ``latest``'s step, the
        newest committed one, or above; ``fence`` before each), and their pieces no other committed step lists."""
        ...

    def trashed(self) -> list[int]:
        """Retired steps that can still be brought back (:meth:`restore`)."""
        ...

    def restore(self, step: int) -> bool:
        """Bring a retired ``step`` back (a late retention moved a step ``latest`` needs); whether it did."""
        ...

    def sweep(self, latest: int, world_size: int) -> None:
        """The last pass: delete staged leftovers at or below ``latest`` that no committed manifest references."""
        ...

    def scratch(self) -> Path:
        """A local dir for the committer's temporary files."""
        ...

    # -- a rank ---------------------------------------------------------------------------------------------
    def rank_dir(self, step: int, rank: int) -> Path:
        """Where rank ``rank`` writes its files of ``step`` (the staged step, or its private scratch dir to
        upload from), without its own marker of an older attempt."""
        ...

    def piece_source(self, rank: int, staged: Path, groups: Mapping[str, str]) -> Pieces:
        """Which of ``rank``'s shared pieces need not be written again (and how one is reused)."""
        ...

    def deliver(self, staged: Path, marker: Marker, reused: frozenset[str] = frozenset()) -> None:
        """Rank ``marker.rank``'s files in ``staged`` are written: make them and then its marker part of the
        staged step (a bucket uploads them, each hash checked against the marker's). ``reused``: pieces the
        latest committed step holds (a bucket: listed, not uploaded)."""
        ...

    def release(self, staged: Path) -> None:
        """Drop the local files of ``staged`` once delivered, where they were only a scratch copy."""
        ...

    @property
    def poll_s(self) -> float:
        """How often a waiting reader looks again (a bucket's listing costs requests)."""
        ...

    # -- readers --------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Before a launch: the store answers and does what the protocol relies on (one line if not)."""
        ...

    def local(self, step: int | None = None) -> CheckpointLayout:
        """A local checkpoints dir holding ``step`` (None: the newest committed step, which its ``latest`` then
        names), for the readers (resume, consolidate, export, ``load(step=...)``): the directory itself, or a
        verified copy pulled from the bucket."""
        ...

    def latest_where(self) -> str: ...

    def manifest_where(self, step: int) -> str: ...

    def describe(self, world_size: int | None) -> dict[str, Any]:
        """What ``status`` shows: latest, committed, staged and quarantined steps, retention."""
        ...
