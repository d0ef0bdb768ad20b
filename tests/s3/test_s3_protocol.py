"""The commit protocol against a real S3-compatible server (SeaweedFS on loopback), in-process.

Faults are injected at every request boundary (the client's own fault points: each PUT, UploadPart,
CompleteMultipartUpload, the manifest PUT and the ``latest`` swap); after each, the invariants hold: ``latest``
names a step that verifies, no step is partially visible, and a fresh committer finishes the work.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import boto3
import pytest

from pipeline.checkpoint.manifest import verify_committed
from pipeline.checkpoint.save import rank_save
from pipeline.checkpoint.save.rank_save import RankTarget
from pipeline.checkpoint.stores.bucket_store import BucketCheckpoints
from pipeline.checkpoint.stores.remote import digest, record_bytes
from pipeline.checkpoint.stores.remote_pull import pull
from pipeline.checkpoint.stores.stores import uncommitted
from pipeline.errors import PipelineError, VerificationError
from pipeline.storage import s3
from pipeline.storage.faults import InjectedFault
from pipeline.storage.integrity import describe
from pipeline.storage.s3 import S3Store, StoreError
from tests.s3.flaky_proxy import flaky_proxy
from tests.s3.helpers import assert_invariants, bucket_store, committer, keys, make_remote, stage_rank, stage_step
from tests.s3.server import S3Server
from tests.seed_helpers import TEST_FORMAT


def test_commit_then_pull_round_trip(tmp_path: Path, bucket: str, prefix: str) -> None:
    layout, remote = make_remote(tmp_path, bucket, prefix)
    stage_step(layout, remote, 4)
    assert uncommitted(BucketCheckpoints(layout, remote), 2) == [4]
    c = committer(layout, remote)
    with c.hold():
        c.recover()
        assert c.commit_ready() == [4]
    assert assert_invariants(layout, remote) == 4
    assert uncommitted(BucketCheckpoints(layout, remote), 2) == []
    # ranks' scratch dirs are gone once uploaded; nothing was staged in the run dir
    assert not any(layout.staging.rglob("*.distcp"))
    cache = pull(remote)
    assert (cache.committed_step(4) / "__1_0.distcp").read_bytes().startswith(b"step=4 rank=1")
    from pipeline.checkpoint.manifest import read_latest, verify_committed

    latest = read_latest(cache)
    assert latest is not None and latest.step == 4
    verify_committed(cache.committed_step(4), 4)
    pointer = json.loads(cache.latest.read_text())  # the local pointer says it is a pulled copy, of what
    assert pointer["copy_of"] == f"s3://{bucket}/{prefix}/latest" and "may be newer" in pointer["note"], pointer


@pytest.mark.parametrize(
    "fault",
    [
        "verify.before_publish",  # before the manifest PUT
        "s3.put@key={P}/step_8/manifest.json",  # the manifest PUT itself
        "verify.before_latest",  # the manifest exists, latest not moved
        "s3.put@key={P}/latest",  # the latest swap (it records the lease epoch)
        "s3.list@prefix={P}/committer/",  # the committer lease's records (listed by every fence)
        "s3.get@key={P}/step_8/a1/__1_0.distcp",  # the verifying re-read
        "s3.list",  # any listing
    ],
)
def test_committer_fault_at_each_request_leaves_a_verified_latest(
    tmp_path: Path, bucket: str, prefix: str, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, remote = make_remote(tmp_path, bucket, prefix)
    stage_step(layout, remote, 4)
    c = committer(layout, remote)
    with c.hold():
        c.commit_ready()
    stage_step(layout, remote, 8)
    monkeypatch.setenv("PIPELINE_FAULTS", fault.replace("{P}", prefix))
    c = committer(layout, remote)
    with pytest.raises((InjectedFault, PipelineError)), c.hold():
        c.recover()
        c.commit_ready()
    monkeypatch.delenv("PIPELINE_FAULTS")
    assert assert_invariants(layout, remote) in (4, 8)  # never a step that does not verify
    c = committer(layout, remote)
    with c.hold():
        c.recover()
        c.commit_ready()
    assert assert_invariants(layout, remote) == 8
    assert remote.committed() == [4, 8]


@pytest.mark.parametrize(
    "point", ["s3.put@key={P}/step_4/a1/__1_0.distcp", "s3.put@key={P}/step_4/a1/rank_1.done.json"]
)
def test_rank_upload_fault_never_commits_the_step(
    tmp_path: Path, bucket: str, prefix: str, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, remote = make_remote(tmp_path, bucket, prefix)
    stage_rank(layout, remote, 4, 0)
    monkeypatch.setenv("PIPELINE_FAULTS", point.replace("{P}", prefix))
    with pytest.raises(InjectedFault):
        stage_rank(layout, remote, 4, 1)
    monkeypatch.delenv("PIPELINE_FAULTS")
    c = committer(layout, remote)
    with c.hold():
        c.recover()
        assert c.commit_ready() == []
        c.finish(None, alive=lambda: False)
    assert c.report.incomplete and "rank(s) 1 wrote no done-marker" in c.report.incomplete[0][1]
    assert remote.read_latest()[0] is None and remote.committed() == []


@pytest.mark.parametrize("point", ["s3.create_multipart", "s3.upload_part@part=2", "s3.complete"])
def test_multipart_fault_aborts_and_the_retry_commits(
    tmp_path: Path, bucket: str, prefix: str, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, remote = make_remote(tmp_path, bucket, prefix)
    big = bytes(range(256)) * (40 << 12)  # 40 MiB: three parts
    stage_rank(layout, remote, 4, 0, payload=big)
    monkeypatch.setenv("PIPELINE_FAULTS", point)
    with pytest.raises(InjectedFault):
        stage_rank(layout, remote, 4, 1, payload=big)
    monkeypatch.delenv("PIPELINE_FAULTS")
    assert boto3.client("s3").list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads") in (
        None,
        [],
    )  # aborted
    stage_rank(layout, remote, 4, 1, payload=big)  # the rank saves again
    c = committer(layout, remote)
    with c.hold():
        assert c.commit_ready() == [4]
    assert assert_invariants(layout, remote) == 4


_KILLED_WRITER = """
import sys
from pathlib import Path
from tests.s3.helpers import make_remote, stage_rank
layout, remote = make_remote(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
stage_rank(layout, remote, 4, 0, attempt="dead", payload=bytes(range(256)) * (40 << 12))
"""


def test_writer_killed_mid_upload_leaves_an_upload_the_committer_aborts(
    tmp_path: Path, bucket: str, prefix: str, s3_env: dict[str, str]
) -> None:
    """A writer process killed (os._exit) between two parts of its multipart upload leaves an incomplete
    upload and no marker: its step never commits, and the committer's sweep aborts the upload once ``latest``
    has passed that step."""
    kill = {**os.environ, "PIPELINE_FAULTS": "s3.upload_part@part=2@action=exit"}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "w"), bucket, prefix],
        env=kill,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 17, proc.stderr[-2000:]
    c3 = boto3.client("s3")
    assert c3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads"), "the dead writer left no upload"
    layout, remote = make_remote(tmp_path, bucket, prefix)
    assert remote.read_marker(4, "dead", 0) is None
    stage_step(layout, remote, 8)
    c = committer(layout, remote)
    with c.hold():
        c.commit_ready()
        c.finish(None, alive=lambda: False)
    assert not c3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")
    assert not any(k.startswith(f"{prefix}/step_4/") for k in keys(bucket, prefix))
    assert assert_invariants(layout, remote) == 8


@pytest.mark.parametrize("damage", ["truncated", "replaced", "missing", "extra"])
def test_damaged_objects_are_quarantined_and_named(tmp_path: Path, bucket: str, prefix: str, damage: str) -> None:
    layout, remote = make_remote(tmp_path, bucket, prefix)
    stage_step(layout, remote, 4)
    key = f"{prefix}/step_4/a1/__1_0.distcp"
    s3 = boto3.client("s3")
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    if damage == "truncated":
        s3.put_object(Bucket=bucket, Key=key, Body=body[:-10])
    elif damage == "replaced":
        s3.put_object(Bucket=bucket, Key=key, Body=body[:-1] + b"X")
    elif damage == "missing":
        s3.delete_object(Bucket=bucket, Key=key)
    else:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/step_4/a1/__7_0.distcp", Body=b"planted")
    c = committer(layout, remote)
    with c.hold():
        assert c.commit_ready() == []
    assert len(c.report.quarantined) == 1
    line = c.report.quarantined[0]
    assert ("__7_0.distcp" if damage == "extra" else "__1_0.distcp") in line
    assert remote.committed() == [] and remote.read_latest()[0] is None
    assert any(
        k.startswith(f"{prefix}/quarantine/step_4-a1-") and k.endswith("reason.txt") for k in keys(bucket, prefix)
    )
    assert not any(k.startswith(f"{prefix}/step_4/") for k in keys(bucket, prefix))


def test_two_committers_racing_commit_exactly_one_attempt(tmp_path: Path, bucket: str, prefix: str) -> None:
    """Two complete attempts of one step, two committers (no shared lock): exactly one manifest is written,
    the other committer loses the If-None-Match and says so; latest names the winner, which verifies."""
    layout, remote = make_remote(tmp_path, bucket, prefix)
    stage_step(layout, remote, 4, attempt="a1")
    stage_step(layout, remote, 4, attempt="a2")
    results: dict[str, object] = {}

    def run(name: str, attempt: str) -> None:
        c = committer(layout, remote)
        markers = remote.markers(4, attempt, 2)
        try:
            results[name] = c.commit(4, [m for m in markers if m is not None])
        except Exception as e:  # noqa: BLE001
            results[name] = e

    threads = [threading.Thread(target=run, args=(f"c{i}", a)) for i, a in enumerate(["a1", "a2"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [v for v in results.values() if isinstance(v, str)]
    losers = [v for v in results.values() if isinstance(v, Exception)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert "already exists and is not this commit's manifest" in str(losers[0])
    assert assert_invariants(layout, remote) == 4
    manifest = remote.read_manifest(4)
    assert manifest is not None and digest(manifest[1]) == winners[0]


def test_planted_manifest_is_never_trusted(tmp_path: Path, bucket: str, prefix: str) -> None:
    layout, remote = make_remote(tmp_path, bucket, prefix)
    stage_step(layout, remote, 4)
    c = committer(layout, remote)
    with c.hold():
        c.commit_ready()
    stage_step(layout, remote, 8)
    s3 = boto3.client("s3")
    # an object planted where step 8's manifest goes, naming a key outside the prefix
    planted = {
        "step": 8,
        "world_size": 1,
        "format": "test-bytes",
        "attempt": "a1",
        "run_id": "x",
        "format_version": 1,
        "files": [{"path": "../../../etc/passwd", "size": 1, "hash": "0"}],
    }
    s3.put_object(Bucket=bucket, Key=f"{prefix}/step_8/manifest.json", Body=record_bytes(planted))
    with pytest.raises(VerificationError, match="could leave its step's prefix"):
        remote.read_manifest(8)
    c = committer(layout, remote)
    with c.hold():
        c.recover()  # the planted manifest does not verify: quarantined, latest stays at 4
        c.commit_ready()
    assert assert_invariants(layout, remote) in (4, 8)
    # latest never named the planted step's bytes
    latest, _ = remote.read_latest()
    assert latest is not None
    got = remote.read_manifest(latest.step)
    assert got is not None and "../" not in got[1].decode()


def test_damaged_latest_moves_back_to_newest_verifying_step(tmp_path: Path, bucket: str, prefix: str) -> None:
    layout, remote = make_remote(tmp_path, bucket, prefix)
    c = committer(layout, remote)
    for step in (4, 8):
        stage_step(layout, remote, step)
        with c.hold():
            c.commit_ready()
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/step_8/a1/__0_0.distcp", Body=b"rot")
    c = committer(layout, remote)
    with c.hold():
        c.recover()
    assert any("step 8" in q for q in c.report.quarantined)
    assert assert_invariants(layout, remote) == 4
    assert remote.committed() == [4]


def test_server_without_conditional_writes_is_refused(s3_env: dict[str, str], bucket: str, prefix: str) -> None:
    """A server that ignores If-None-Match/If-Match (here: a client that drops them before sending) is refused
    with one line: nothing would stop two committers, or latest going back."""
    store = S3Store(bucket)
    orig = store.put

    def careless(key: str, data: bytes, **_: object) -> str:
        return orig(key, data)

    store.put = careless  # type: ignore[method-assign]
    s3._CONDITIONAL_OK.clear()
    with pytest.raises(StoreError, match="does not enforce conditional writes"):
        store.check_conditional_writes(f"{prefix}")
    S3Store(bucket).check_conditional_writes(f"{prefix}")  # the real server passes


class _Killed(BaseException):
    """The process dies here (nothing after it runs, no ``except Exception`` catches it)."""


def test_a_probe_left_by_a_killed_launch_is_collected_by_the_next_committer(
    tmp_path: Path, bucket: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conditional-write probe writes its objects under a reserved name at the run's root. A launch killed
    between the probe's PUT and its delete leaves one; the next committer's first pass deletes it once it is
    older than a probe can take (a younger one may be another process's probe in flight), and nothing else."""
    layout, remote = make_remote(tmp_path, bucket, prefix)
    stage_step(layout, remote, 4)
    c = committer(layout, remote)
    with c.hold():
        c.recover()
        assert c.commit_ready() == [4]

    store = S3Store(bucket)
    real_put, sent = store.put, []

    def put_then_die(key: str, data: bytes, **kw: object) -> str:
        sent.append(key)
        if len(sent) > 1:
            raise _Killed
        return real_put(key, data, **kw)  # type: ignore[arg-type]

    store.put = put_then_die  # type: ignore[method-assign]
    s3._CONDITIONAL_OK.clear()
    with pytest.raises(_Killed):
        store.check_conditional_writes(prefix)
    litter = sent[0]
    assert litter.startswith(f"{prefix}/{s3.PROBE_NAME}") and litter in keys(bucket, prefix)
    lookalikes = [  # not probes of this root: a name without the reserved prefix, a deeper key, another run's root
        f"{prefix}/conditional-probe-x",
        f"{prefix}/{s3.PROBE_NAME}x/nested",
        f"{prefix}x/{s3.PROBE_NAME}other-run",
    ]
    for key in lookalikes:
        real_put(key, b"keep")
    unleased = lambda: {k for k in keys(bucket, prefix) if f"{prefix}/committer/" not in k}  # noqa: E731 - lease records
    before = unleased()

    with c.hold():  # the next committer run, while the probe may still be in flight: kept
        c.recover()
    assert unleased() == before

    monkeypatch.setattr(s3, "PROBE_STALE_S", 0.0)  # the probe is now older than any probe takes
    nxt = committer(layout, remote)
    with nxt.hold():
        nxt.recover()
    after = unleased()
    assert before - after == {litter}, sorted(before ^ after)
    assert set(lookalikes) <= after
    assert assert_invariants(layout, remote) == 4


def test_retention_deletes_manifest_first_and_never_a_referenced_object(
    tmp_path: Path, bucket: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.checkpoint.stores import bucket_trash  # noqa: PLC0415

    monkeypatch.setattr(bucket_trash, "GRACE_S", 0.0)  # a retired step is purged in the pass that retires it here
    layout, remote = make_remote(tmp_path, bucket, prefix)
    c = committer(layout, remote, keep_last=2)
    for step in (1, 2, 3, 4, 5, 6):
        stage_step(layout, remote, step)
        if step == 5:  # a crash inside retention, after the manifest of step 3 went
            monkeypatch.setenv(
                "PIPELINE_FAULTS",
                f"s3.delete@key={prefix}/step_3/a1/__0_0.distcp",
            )
        with c.hold(), contextlib.suppress(InjectedFault):
            c.commit_ready()
        monkeypatch.delenv("PIPELINE_FAULTS", raising=False)
        assert_invariants(layout, remote)
        for kept in remote.committed():  # every committed step's objects are all there
            got = remote.read_manifest(kept)
            assert got is not None
            remote.fetch_verified(got[0], None)
    assert remote.committed() == [5, 6]
    with c.hold():
        bucket_store(c).sweep_unreferenced()
    left = {k.split("/")[2] for k in keys(bucket, f"{prefix}/step_")}
    assert left == {"step_5", "step_6"}


def test_rank_target_scratch_is_rank_private(tmp_path: Path, bucket: str, prefix: str) -> None:
    layout, remote = make_remote(tmp_path, bucket, prefix)
    a = rank_save.prepare(RankTarget(layout=layout, rank=0, world_size=2, attempt="a", remote=remote), 4)
    b = rank_save.prepare(RankTarget(layout=layout, rank=1, world_size=2, attempt="a", remote=remote), 4)
    assert a != b and a.parent.parent == b.parent.parent == layout.staging


def test_connection_resets_lost_responses_and_stalls_are_retried(
    tmp_path: Path, s3_server: S3Server, bucket: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a loopback proxy that resets new connections, loses responses after the server acted (a manifest
    PUT that landed, retried into its own If-None-Match) and stalls others past the read timeout: the client's
    retries carry the saves and commits through, and the bucket ends exactly as without faults."""
    modes = ["drop", "ok", "reset", "ok", "stall", "ok"]
    with flaky_proxy(s3_server.endpoint, lambda i: modes[i % len(modes)]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("PIPELINE_S3_TIMEOUT_S", "1")
        monkeypatch.setenv("PIPELINE_S3_ATTEMPTS", "8")
        s3._clients.clear()
        layout, remote = make_remote(tmp_path, bucket, prefix)
        for step in (4, 8):
            stage_step(layout, remote, step)
            c = committer(layout, remote)
            with c.hold():
                c.recover()
                assert c.commit_ready() == [step]
        assert {m for _, m in proxy.faults} == {"drop", "reset", "stall"}, proxy.faults
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    s3._clients.clear()
    assert assert_invariants(layout, remote) == 8
    assert remote.committed() == [4, 8] and not c.report.quarantined


def test_a_file_changed_after_its_write_is_never_uploaded_as_it(tmp_path: Path, bucket: str, prefix: str) -> None:
    """The hash taken while uploading must equal the one taken while writing: a file changed in between (same
    size, other bytes) fails the rank's save, and no marker object is written."""
    layout, remote = make_remote(tmp_path, bucket, prefix)
    t = RankTarget(layout=layout, rank=0, world_size=1, attempt="a1", remote=remote)
    scratch = rank_save.prepare(t, 4)
    (scratch / "__0_0.distcp").write_bytes(b"A" * 1000)
    entry = describe(scratch, "__0_0.distcp")
    (scratch / "__0_0.distcp").write_bytes(b"B" * 1000)
    with pytest.raises(VerificationError, match="changed between its write and its upload"):
        rank_save.finish(t, scratch, 4, TEST_FORMAT, (entry,))
    assert remote.read_marker(4, "a1", 0) is None


def test_pull_replaces_a_link_planted_where_the_copy_goes(tmp_path: Path, bucket: str, prefix: str) -> None:
    """A symlink at ``checkpoints/step_4`` (even to a dir holding the right manifest) is never read or reused:
    the pull moves it aside and publishes a real, verified directory."""
    layout, remote = make_remote(tmp_path, bucket, prefix)
    stage_step(layout, remote, 4)
    c = committer(layout, remote)
    with c.hold():
        c.commit_ready()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    got = remote.read_manifest(4)
    assert got is not None
    (elsewhere / "manifest.json").write_bytes(got[1])
    (layout.checkpoints / "step_4").symlink_to(elsewhere)
    cache = pull(remote)
    assert not cache.committed_step(4).is_symlink() and cache.committed_step(4).is_dir()
    verify_committed(cache.committed_step(4), 4)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["manifest.json"]  # nothing written through the link
