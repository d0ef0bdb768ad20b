"""Checkpoints in a bucket: the protocol's store over an S3-compatible object store, committed without a rename.

Inputs: ``step_N/<attempt>/`` objects and each rank's ``rank_K.done.json`` object
(:mod:`pipeline.checkpoint.stores.remote`).
Outputs: ``step_N/manifest.json`` written with ``If-None-Match: *`` (the commit point) once every listed object
was re-read and matched its size and hash (and nothing unlisted sits beside them), then ``latest`` moved by
compare-and-swap; a refused attempt's objects are copied to ``quarantine/`` and removed; retention deletes a
step's manifest first and its objects after; a sweep deletes objects that no committed manifest references
(other attempts of a committed step, attempts of steps that ``latest`` superseded) and aborts incomplete
multipart uploads there (dead writers').
Owner: the one committer (:class:`~pipeline.checkpoint.protocol.committer.Committer`), which holds the committer lease,
an object written by compare-and-swap; the manifest's ``If-None-Match`` besides, so of two committers racing for
a step exactly one commits it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.checkpoint.manifest import Latest, Manifest, Marker, Metrics
from pipeline.checkpoint.protocol.ownership import CommitterBusy, LeaseStore
from pipeline.checkpoint.protocol.step_checks import check_agreement, check_stored, foreign_files
from pipeline.checkpoint.stores.bucket_removal import BucketRemoval
from pipeline.checkpoint.stores.bucket_status import remote_checkpoints
from pipeline.checkpoint.stores.remote import (
    LATEST,
    QUARANTINE,
    WITHDRAWN,
    Remote,
    digest,
    is_marker_name,
    parse_record,
    record_bytes,
)
from pipeline.checkpoint.stores.remote_pull import pull
from pipeline.checkpoint.stores.store import ANY, Taken
from pipeline.errors import PipelineError, VerificationError
from pipeline.storage.atomic import remove_tree
from pipeline.storage.backend import POSIX
from pipeline.storage.faults import inject
from pipeline.storage.layout import CheckpointLayout, step_name
from pipeline.storage.s3 import Conflict

if TYPE_CHECKING:
    from pipeline.formats.dcp_pieces import Pieces

log = logging.getLogger(__name__)


class BucketCheckpoints(BucketRemoval):
    """The checkpoints root ``remote`` (``s3://bucket/prefix``), with ``layout`` its local side (the committer's
    lock and temporary files, the retention record)."""

    def __init__(self, layout: CheckpointLayout, remote: Remote) -> None:
        self.layout = layout
        self.remote = remote
        self._first_seen = {}

    @property
    def where(self) -> str:
        return self.remote.url(self.remote.root.prefix)

    def scratch(self) -> Path:
        return self.layout.checkpoints

    # -- ownership ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        """The bucket's conditional writes are checked first: the lease itself is one (compare-and-swap)."""
        self.remote.store.check_conditional_writes(self.remote.root.prefix)
        POSIX.makedirs(self.layout.checkpoints)
        with POSIX.exclusive(self.layout.committer_lock) as mine:  # one node: the kernel's lock, fast
            if not mine:
                raise CommitterBusy(
                    f"another committer holds {self.layout.committer_lock}: exactly one commits {self.where} "
                    "(stop the other one, or let it finish)"
                )
            yield

    def lease_store(self) -> LeaseStore:
        return self.remote.lease_store()

    # -- latest ---------------------------------------------------------------------------------------------

    def read_latest(self) -> Latest | None:
        found = self.remote.verified_latest()
        return Latest(step=found[0].step, manifest_hash=digest(found[1])) if found is not None else None

    def latest_epoch(self) -> int | None:
        got = self.remote.store.get(self.remote.key(LATEST))
        try:
            obj = json.loads(got[0]) if got is not None else None
        except ValueError:
            return None
        epoch = obj.get("epoch") if isinstance(obj, dict) else None
        return epoch if type(epoch) is int else None

    def latest_named(self) -> int | None:
        try:
            latest, _ = self.remote.read_latest()
        except VerificationError:
            return None
        return latest.step if latest is not None else None

    def newest(self) -> Latest | None:
        """The newest committed step (:meth:`Remote.newest_manifest`): ``latest`` may lag behind it or, moved late
        by a stale committer, name an older one; a pass then moves ``latest`` up once that step verifies."""
        found = self.remote.newest_manifest()
        return Latest(step=found[0].step, manifest_hash=digest(found[1])) if found is not None else None

    def latest_version(self) -> str | None:
        info = self.remote.store.head(self.remote.key(LATEST))
        return info.etag if info is not None else None

    def move_latest(
        self, step: int, manifest_hash: str, epoch: int | None, *, back: bool = False, expect: str | None = ANY
    ) -> None:
        """Forward only, by compare-and-swap; ``back`` (the repair of damage) is swapped against ``expect``, the
        version of ``latest`` read before the verification that justified it."""
        self.remote.move_latest(step, manifest_hash, back=back, epoch=epoch, expect=expect)

    def drop_latest(self, problem: str) -> str:
        """A damaged ``latest``: copied to ``quarantine/`` with the reason, then deleted."""
        remote = self.remote
        dst = remote.key(QUARANTINE, f"latest-{int(time.time())}") + "/"
        if remote.store.head(remote.key(LATEST)) is not None:
            remote.store.copy(remote.key(LATEST), dst + LATEST)
        remote.store.put(dst + "reason.txt", (problem + "\n").encode())
        self.remove_latest()
        log.error("quarantined %s to %s: %s", remote.url(remote.key(LATEST)), remote.url(dst), problem)
        return remote.url(dst)

    def remove_latest(self, expect: str | None = ANY) -> None:
        if expect is not ANY and self.latest_version() != expect:
            return  # moved by another committer since it was found damaged: theirs
        self.remote.store.delete([self.remote.key(LATEST)])

    # -- committed steps ------------------------------------------------------------------------------------

    def committed(self) -> list[int]:
        return self.remote.committed()

    def is_published(self, step: int) -> bool:
        info = self.remote.store.head(self.remote.manifest_key(step))
        return info is not None and info.size > 0  # an empty one was taken back by its writer: it commits nothing

    def committed_attempt(self, step: int) -> str | None:
        if not self.is_published(step):
            return None
        found = self.remote.read_manifest_or_none(step)
        return found.attempt if found is not None else ""

    def manifest_hash(self, step: int) -> str | None:
        got = self.remote.store.get(self.remote.manifest_key(step))
        return digest(got[0]) if got is not None and got[0] != WITHDRAWN else None

    def verify_committed(self, step: int) -> str:
        found = self.remote.read_manifest(step)
        if found is None:
            raise VerificationError(f"{self.remote.url(self.remote.manifest_key(step))} is missing")
        self.remote.fetch_verified(found[0], None)
        return digest(found[1])

    def step_metrics(self, step: int) -> Metrics:
        try:
            found = self.remote.read_manifest_or_none(step)
        except PipelineError:
            return {}
        return found.metrics if found is not None else {}

    def stray(self) -> list[str]:
        return []  # keys are names, never links

    def unfinished(self) -> list[int]:
        return []  # the manifest object is the one act that publishes a step

    def finishing(self, world_size: int) -> list[int]:
        return []

    # -- staged steps ---------------------------------------------------------------------------------------

    def staged(self) -> list[int]:
        committed = set(self.remote.committed())
        return [s for s in self.remote.steps() if s not in committed and self.remote.attempts(s)]

    def attempts(self, step: int) -> list[str | None]:
        return list(self.remote.attempts(step))

    def markers(self, step: int, attempt: str | None, world_size: int) -> list[Marker | None]:
        if attempt is None:
            raise VerificationError(f"step {step}: a marker in a bucket is read per attempt")
        return self.remote.markers(step, attempt, world_size)

    def staged_where(self, step: int) -> str:
        return self.remote.url(self.remote.step_prefix(step))

    def verify_staged(self, step: int, markers: list[Marker], allow_pickle: bool) -> Manifest:
        """Verify ``step``'s objects against its markers (sizes, a full re-read for hashes, nothing extra) and
        the format's own metadata."""
        remote = self.remote
        attempt = markers[0].attempt
        prefix = remote.attempt_prefix(step, attempt)
        fmt, files = check_agreement(step, markers, remote.url(prefix))
        bad = foreign_files(markers, fmt)
        if bad is not None:
            raise VerificationError(
                f"{remote.url(remote.marker_key(step, attempt, bad[0].rank))} lists {bad[1]}, which {fmt.name} names "
                "as another rank's files: each rank lists only the files it owns"
            )
        listed = {prefix + f.path for f in files}
        extra = sorted(
            k for k in remote.store.listing(prefix) if k not in listed and not is_marker_name(k[len(prefix) :])
        )
        if extra:
            raise VerificationError(f"{remote.url(extra[0])} is in step {step} but no marker lists it")
        manifest = Manifest(
            step=step,
            world_size=markers[0].world_size,
            format=markers[0].format,
            attempt=attempt,
            run_id=self.layout.run_id,
            files=files,
            metrics=dict(markers[0].metrics),
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".verify-step_{step}-", dir=self.scratch()))
        try:
            remote.fetch_verified(manifest, tmp)  # every byte re-read and hashed
            check_stored(fmt, tmp, step, markers, allow_pickle)
        finally:
            remove_tree(tmp)
        return manifest

    def publish(self, manifest: Manifest) -> str | None:
        inject("verify.before_publish", step=manifest.step)
        try:
            return create_manifest(self.remote, manifest)
        except Conflict as e:
            raise Taken(str(e)) from None

    def taken_by_another(self, step: int, wait: bool) -> bool:
        return self.is_published(step)

    def raced(self, step: int) -> bool:
        return self.is_published(step)

    def holes(self, upto: int) -> list[int]:
        return []  # the commit point is one conditional write: a raced publish leaves no half-published step

    # -- a rank ---------------------------------------------------------------------------------------------

    def rank_dir(self, step: int, rank: int) -> Path:
        """Rank-private: ``staging/.upload-rank_K/step_N``, emptied (only this rank ever writes there)."""
        scratch = self.layout.staging / f".upload-rank_{rank}" / step_name(step)
        if scratch.exists():
            remove_tree(scratch)
        scratch.mkdir(parents=True)
        return scratch

    def piece_source(self, rank: int, staged: Path, groups: Mapping[str, str]) -> Pieces:
        from pipeline.checkpoint.save import pieces  # noqa: PLC0415 - a rank's (torch); a committer never loads it

        return pieces.bucket_source(self.remote, rank, groups)

    def deliver(self, staged: Path, marker: Marker, reused: frozenset[str] = frozenset()) -> None:
        self.remote.upload_rank(staged, marker, reused)  # the files, then the marker object last

    def release(self, staged: Path) -> None:
        remove_tree(staged)

    @property
    def poll_s(self) -> float:
        return 0.5

    # -- readers ------------------------------------------------------------------------------------------

    def check(self) -> None:
        self.remote.store.check_conditional_writes(self.remote.root.prefix)

    def local(self, step: int | None = None) -> CheckpointLayout:
        return pull(self.remote, step)

    def latest_where(self) -> str:
        return self.remote.url(self.remote.key(LATEST))

    def manifest_where(self, step: int) -> str:
        return self.remote.url(self.remote.manifest_key(step))

    def describe(self, world_size: int | None) -> dict[str, Any]:
        return remote_checkpoints(self.remote)

    def latest_step(self) -> int:
        latest = self.newest()
        return latest.step if latest else 0


def create_manifest(remote: Remote, manifest: Manifest) -> str:
    """Write ``step_N/manifest.json`` only if none exists (the commit point); returns its hash. The same bytes
    already there (a retried request that had landed) count as ours; anything else is a Conflict."""
    data = record_bytes(manifest.to_json())
    key = remote.manifest_key(manifest.step)
    try:
        etag = remote.store.put(key, data, if_none_match=True)
    except Conflict:
        got = remote.store.get(key)
        if got is not None and got[0] != data and (got[0] == WITHDRAWN or not _marked(remote, manifest.step, got[0])):
            # a manifest its writer took back, or a stale committer's late manifest of a step retired since (its
            # rank 0 marker gone): commits nothing, and is replaced only as that very object (If-Match)
            etag = remote.store.put(key, data, if_match=got[1])
        elif got is None or got[0] != data:
            raise Conflict(
                f"{remote.url(key)} already exists and is not this commit's manifest (another committer committed the "
                "step, or an object was planted there)"
            ) from None
        else:
            etag = got[1]
    # A committer paused before that write lands it late: if retention purged the step meanwhile (its rank 0 marker
    # goes first), or a quarantine took its attempt, the manifest commits nothing (readers require the marker), and
    # it is taken back: only the object this write made (If-Match), never whatever is there now (by then another
    # committer may have committed the step again, a newer attempt: found as suspicion (a) of issue 48).
    attempt = remote.attempt_prefix(manifest.step, manifest.attempt)
    if remote.marker_key(manifest.step, manifest.attempt, 0) not in remote.store.listing(attempt):
        remote.withdraw_manifest(manifest.step, etag)
        raise Conflict(
            f"step {manifest.step}'s objects ({remote.url(attempt)}) were removed while this committer was paused "
            "before committing it: not committed"
        )
    return digest(data)


def _marked(remote: Remote, step: int, data: bytes) -> bool:
    """Whether the manifest ``data`` of ``step`` commits anything: its attempt's rank 0 marker exists."""
    where = remote.url(remote.manifest_key(step))
    try:
        found = Manifest.from_json(parse_record(data, "manifest", where), where)
        return remote.store.head(remote.marker_key(step, found.attempt, 0)) is not None
    except VerificationError:
        return True  # not a manifest of ours: left to the committer's repair, never overwritten here
