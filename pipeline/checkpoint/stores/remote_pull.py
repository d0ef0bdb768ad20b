"""A bucket's committed step as a local, verified copy: what every local reader (resume, consolidate, export) reads.

The copy goes to ``<cache>/checkpoints/step_N`` (the cache is a :class:`CheckpointLayout` root), published by one
rename once every file matched its manifest's size and hash; the cache then gets a ``latest`` naming it and holds
that one step (the bucket is the store). That ``latest`` says it is a copy (``copy_of``, ``pulled_at``): it names
the step last pulled, which the bucket's own ``latest`` may have passed.
"""

from __future__ import annotations

import logging
import uuid

from pipeline.checkpoint.manifest import MANIFEST, write_latest
from pipeline.checkpoint.stores.remote import LATEST, Remote, digest
from pipeline.errors import VerificationError
from pipeline.storage import atomic
from pipeline.storage.integrity import lstat_kind
from pipeline.storage.layout import CheckpointLayout, parse_step

log = logging.getLogger(__name__)


def pull(remote: Remote, step: int | None = None) -> CheckpointLayout:
    """A local, verified copy of ``step`` (default: the newest committed step) in the cache, which gets a
    ``latest`` naming it; returns the cache's layout. A copy already there with the same manifest is reused."""
    cache = remote.cache
    found = remote.newest_manifest() if step is None else remote.read_manifest(step)
    if found is None and step is None:
        return cache
    if found is None:
        raise VerificationError(
            f"{remote.url(remote.manifest_key(step or 0))} is missing: step {step} is not committed"
        )
    manifest, raw = found
    mhash = digest(raw)
    final = cache.committed_step(manifest.step)
    have = final / MANIFEST
    # lstat, never followed: a link planted where the copy goes is replaced, not read or reused
    reuse = lstat_kind(final) == "dir" and lstat_kind(have) == "file" and digest(have.read_bytes()) == mhash
    if not reuse:
        cache.checkpoints.mkdir(parents=True, exist_ok=True)
        tmp = cache.checkpoints / f".pull-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            markers = remote.markers(manifest.step, manifest.attempt, manifest.world_size)
            remote.fetch_verified(manifest, tmp)
            for m in markers:
                if m is not None:
                    atomic.write_json_atomic(tmp / f"rank_{m.rank}.done.json", m.to_json())
            atomic.write_bytes_atomic(tmp / MANIFEST, raw)
            if lstat_kind(final) is not None:
                atomic.remove_tree(final)  # renames the entry itself (a link is moved, not followed)
            atomic.publish_dir(tmp, final)
        finally:
            if tmp.exists():
                atomic.remove_tree(tmp)
        log.info("pulled step %d from %s into %s", manifest.step, remote.root, final)
    write_latest(cache, manifest.step, mhash, copy_of=remote.url(remote.key(LATEST)))
    for old in cache.checkpoints.iterdir():
        s = parse_step(old.name)
        if s is not None and s != manifest.step:
            atomic.remove_tree(old)  # the cache holds one step: the bucket is the store
    return cache
