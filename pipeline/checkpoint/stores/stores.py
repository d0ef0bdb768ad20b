"""Which store a checkpoints root is: the one place that chooses between the implementations of
:class:`~pipeline.checkpoint.stores.store.CheckpointStore`."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.checkpoint.manifest import complete_markers
from pipeline.checkpoint.protocol.lease_records import Watch
from pipeline.checkpoint.protocol.ownership import Holder, newest_holder
from pipeline.checkpoint.stores.bucket_store import BucketCheckpoints
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.checkpoint.stores.remote import Remote
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.errors import VerificationError
from pipeline.storage import atomic
from pipeline.storage.backend import held_elsewhere
from pipeline.storage.integrity import read_record_json
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.reads import failed, is_transient
from pipeline.storage.s3 import S3Url

STORE_RECORD = "storage.json"
"""``<dir>/checkpoints/storage.json``: where a library checkpoint dir keeps its checkpoints (``{"storage": url}``),
written by the :class:`~pipeline.checkpoint.Checkpointer` so the command lines find the bucket by the dir alone."""


def remote_at(url: str | None, cache_dir: Path, what: str = "storage") -> Remote | None:
    """The checkpoints root ``url`` (``s3://bucket/prefix``; None: the one ``cache_dir`` records, if any) with its
    local cache in ``cache_dir``."""
    if url is None:
        url = recorded_store(CheckpointLayout(cache_dir))
    return None if url is None else Remote(root=S3Url.parse(url, what), cache_dir=cache_dir)


def record_store(layout: CheckpointLayout, url: str) -> None:
    atomic.write_json_atomic(layout.checkpoints / STORE_RECORD, {"storage": url})


def recorded_store(layout: CheckpointLayout) -> str | None:
    """The bucket a library checkpoint dir records (None: its checkpoints are local)."""
    path = layout.checkpoints / STORE_RECORD
    try:
        obj = read_record_json(path, "storage record")
    except FileNotFoundError:
        return None
    url = obj.get("storage") if isinstance(obj, dict) else None
    if not isinstance(url, str):
        raise VerificationError(f'{path} is malformed: it must be {{"storage": "s3://..."}}')
    return url


def store_for(layout: CheckpointLayout, remote: Remote | None) -> CheckpointStore:
    """The checkpoints of ``layout``: its own directory, or the bucket ``remote`` (``layout`` its local side)."""
    if remote is not None:
        return BucketCheckpoints(layout, remote)
    return PosixCheckpoints(layout)


def library_store(layout: CheckpointLayout, url: str | None = None, what: str = "storage") -> CheckpointStore:
    """A library checkpoint dir's store: the bucket ``url`` (None: the one the dir records, if any), else the dir
    itself (``what``: the option that gave ``url``, named in an error)."""
    return store_for(layout, remote_at(url, layout.run_dir, what))


def uncommitted(store: CheckpointStore, world_size: int, upto: int | None = None) -> list[int]:
    """Steps newer than the newest committed one staged with every rank's marker (one attempt) but not committed
    yet: what a resuming trainer waits for, so a step staged before a kill is never lost nor trained again; and
    what a library job's close names when no committer committed them; and steps moved into place whose
    manifest is not written yet (:meth:`~pipeline.checkpoint.stores.store.CheckpointStore.finishing`). ``upto``:
    none above it."""
    try:
        newest = store.newest()
    except (VerificationError, OSError, ValueError) as e:
        if is_transient(e):  # unknown: never a resume that skips a staged step for it
            raise failed(e, "latest pointer", store.latest_where()) from e
        return []  # the committer repairs latest first; resuming then reports what it found
    done = newest.step if newest is not None else 0
    pending = []
    # a bucket's step above the newest good one may hold a bad committed copy beside a new attempt (saved again
    # after the fall-back): that attempt counts (found by tests/simulate.py, seed 827)
    for step in sorted({*store.staged(), *(s for s in store.committed() if s > done)}):
        if step <= done or (upto is not None and step > upto):
            continue
        published = store.is_published(step)
        committed = store.committed_attempt(step) if published else None
        for attempt in store.attempts(step):
            try:
                markers = complete_markers(store.markers(step, attempt, world_size), None)
            except VerificationError:
                continue
            # a new attempt beside a bad committed copy (saved again after the fall-back) counts
            if markers and not (published and markers[0].attempt == committed):
                pending.append(step)
                break
    # Moved into place, its manifest not yet written (a commit between its two acts, or cut there): it is neither
    # staged nor committed to a reader, yet the committer's next act commits it (found by tests/simulate.py).
    finishing = [s for s in store.finishing(world_size) if s > done and (upto is None or s <= upto)]
    return sorted({*pending, *finishing})


def live_holder(store: CheckpointStore, watch: Watch | None = None) -> Holder | None:
    """The committer of ``store`` that looks alive, on any node (None: no live one). ``watch``: a caller that polls
    keeps one across its looks and is told by whether the record changes on its own clock (a holder's clock
    skewed by more than its lease misleads nothing); without it, one look compares the heartbeat with this
    machine's clock (:meth:`Holder.live`: status)."""
    held = newest_holder(store.lease_store())
    if watch is not None:
        return held if watch.live(held) else None
    return held if held is not None and held.live(time.time()) else None


def committer_running(store: CheckpointStore, watch: Watch | None = None) -> bool:
    """Whether a committer of ``store`` runs: the node-local lock held here, or a live lease anywhere (``watch``:
    see :func:`live_holder`; a caller that polls passes the same one every time)."""
    return held_elsewhere(store.layout.committer_lock) or live_holder(store, watch) is not None
