"""Staging fake steps into a bucket through the real rank path (scratch dir, upload, marker object last)."""

from __future__ import annotations

from pathlib import Path

import boto3

from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer
from pipeline.checkpoint.save import rank_save
from pipeline.checkpoint.save.rank_save import RankTarget
from pipeline.checkpoint.stores.bucket_store import BucketCheckpoints
from pipeline.checkpoint.stores.remote import Remote
from pipeline.storage.integrity import describe
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.s3 import S3Url
from tests.seed_helpers import TEST_FORMAT, shard_bytes


def make_remote(tmp: Path, bucket: str, prefix: str = "runs/r1") -> tuple[CheckpointLayout, Remote]:
    layout = CheckpointLayout(tmp / "run")
    for d in layout.checkpoint_dirs():
        d.mkdir(parents=True, exist_ok=True)
    return layout, Remote(root=S3Url(bucket, prefix), cache_dir=layout.run_dir)


def stage_rank(
    layout: CheckpointLayout,
    remote: Remote,
    step: int,
    rank: int,
    *,
    world: int = 2,
    attempt: str = "a1",
    payload: bytes | None = None,
) -> None:
    """One rank's save of ``step``: its file ``__<rank>_0.distcp`` into its scratch dir, uploaded, then its marker."""
    t = RankTarget(layout=layout, rank=rank, world_size=world, attempt=attempt, remote=remote)
    scratch = rank_save.prepare(t, step)
    name = f"__{rank}_0.distcp"
    (scratch / name).write_bytes(payload if payload is not None else shard_bytes(step, rank, name))
    rank_save.finish(t, scratch, step, TEST_FORMAT, (describe(scratch, name),))


def stage_step(layout: CheckpointLayout, remote: Remote, step: int, *, world: int = 2, attempt: str = "a1") -> None:
    for rank in range(world):
        stage_rank(layout, remote, step, rank, world=world, attempt=attempt)


def committer(layout: CheckpointLayout, remote: Remote, world: int = 2, **policy: object) -> Committer:
    kw: dict[str, object] = {"marker_deadline_s": 1.0, "poll_interval_s": 0.05, **policy}
    return Committer(layout, CommitPolicy(world_size=world, **kw), BucketCheckpoints(layout, remote))  # type: ignore[arg-type]


def client() -> object:
    return boto3.client("s3")


def keys(bucket: str, prefix: str = "") -> dict[str, int]:
    c = boto3.client("s3")
    out: dict[str, int] = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def assert_invariants(layout: CheckpointLayout, remote: Remote) -> int:
    """``latest`` (if any) names a step whose manifest and every file verify, and every manifest present (a
    visible step) verifies completely: no partially visible step. Returns latest's step (0: none)."""
    found = remote.verified_latest()
    for step in remote.committed():
        got = remote.read_manifest(step)
        assert got is not None
        remote.fetch_verified(got[0], None)
    if found is None:
        return 0
    remote.fetch_verified(found[0], None)
    return found[0].step


def bucket_store(c: Committer) -> BucketCheckpoints:
    """The bucket store a committer of :func:`committer` commits to."""
    if not isinstance(c.store, BucketCheckpoints):
        raise TypeError(f"{c.store!r} is not a bucket store")
    return c.store
