"""Which store a checkpoints root is: the one place that chooses between the implementations of
:class:`~pipeline.checkpoint.store.CheckpointStore`."""

from __future__ import annotations

from pipeline.checkpoint.bucket_store import BucketCheckpoints
from pipeline.checkpoint.posix_store import PosixCheckpoints
from pipeline.checkpoint.remote import Remote, remote_at
from pipeline.checkpoint.store import CheckpointStore
from pipeline.storage.layout import CheckpointLayout


def store_for(layout: CheckpointLayout, remote: Remote | None) -> CheckpointStore:
    """The checkpoints of ``layout``: its own directory, or the bucket ``remote`` (``layout`` its local side)."""
    if remote is not None:
        return BucketCheckpoints(layout, remote)
    return PosixCheckpoints(layout)


def library_store(layout: CheckpointLayout, url: str | None = None, what: str = "storage") -> CheckpointStore:
    """A library checkpoint dir's store: the bucket ``url`` (None: the one the dir records, if any), else the dir
    itself (``what``: the option that gave ``url``, named in an error)."""
    return store_for(layout, remote_at(url, layout.run_dir, what))
