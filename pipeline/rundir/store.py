"""A run's checkpoints: in its run dir, or under ``<checkpoint.storage>/<experiment>/<run_id>/`` in a bucket.

Decided by the config's URL and the run id, never per rank; read without the app's config (``status`` passes
the URL ``run.yaml`` records).
"""

from __future__ import annotations

from pipeline.checkpoint.stores.remote import Remote
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.checkpoint.stores.stores import store_for
from pipeline.rundir.layout import RunLayout
from pipeline.storage.s3 import S3Url


def run_remote(url: str | None, layout: RunLayout) -> Remote | None:
    """The run's checkpoints root in the bucket ``url`` (None for none), its local side the run dir."""
    if not url:
        return None
    root = S3Url.parse(url).join(layout.run_dir.parent.name, layout.run_id)
    return Remote(root=root, cache_dir=layout.run_dir)


def run_store(url: str | None, layout: RunLayout) -> CheckpointStore:
    """The run's checkpoints: in the bucket ``url``, else in the run dir."""
    return store_for(layout, run_remote(url, layout))
