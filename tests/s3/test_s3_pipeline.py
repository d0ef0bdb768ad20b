"""``python -m pipeline +experiment=tiny checkpoint.storage=s3://...`` against SeaweedFS on loopback, as a user
runs it: end to end, killed and resumed, the same bytes as a run in the run dir, read back by status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3

from pipeline.checkpoint.manifest import read_manifest
from pipeline.checkpoint.stores.remote import Remote
from pipeline.config.compose import load_config
from pipeline.rundir.layout import RunLayout
from pipeline.stages.import_checkpoint import probe
from pipeline.storage.integrity import hash_file
from pipeline.storage.s3 import S3Url
from tests.conftest import run_cli

FAST = ("launcher.poll_interval_s=0.3",)


def _hashes_local(layout: RunLayout, step: int) -> dict[str, tuple[int, str]]:
    return {f.path: (f.size, f.hash) for f in read_manifest(layout.committed_step(step)).files}


def _hashes_remote(remote: Remote, step: int) -> dict[str, tuple[int, str]]:
    got = remote.read_manifest(step)
    assert got is not None, f"step {step} is not committed in {remote.root}"
    return {f.path: (f.size, f.hash) for f in got[0].files}


def test_tiny_on_s3_killed_resumed_and_equal_to_a_local_run(
    tmp_path: Path, s3_env: dict[str, str], bucket: str, prefix: str
) -> None:
    storage = f"checkpoint.storage=s3://{bucket}/{prefix}"
    base = ("+experiment=tiny", f"run.root={tmp_path}", "run.create=true", *FAST)
    kill = {**s3_env, "PIPELINE_FAULTS": "shard_save.before_marker@rank=1@step=8@action=exit"}
    proc = run_cli(*base, "run.id=k", storage, env=kill)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step 8: rank(s) 1 wrote no done-marker" in proc.stdout
    assert "failed; latest = step 4;" in proc.stdout  # read from the bucket
    remote = Remote(root=S3Url(bucket, prefix).join("tiny", "k"), cache_dir=tmp_path)
    latest, _ = remote.read_latest()
    assert latest is not None and latest.step == 4 and remote.committed() == [4]

    # a plain rerun resumes from the bucket; its saves upload in the background (async_save)
    proc = run_cli(*base, "run.id=k", storage, "checkpoint.async_save=true", env=s3_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    layout = RunLayout.for_run(tmp_path, "tiny", "k")
    assert json.loads(layout.stage_record("train").read_text())["summary"]["resumed_from"] == 4
    assert f"latest:   s3://{bucket}/{prefix}/tiny/k/latest -> step 8" in proc.stdout
    assert (layout.export_step(8) / "config.json").is_file()
    assert remote.committed() == [4, 8]
    # nothing half-written is left: no incomplete multipart upload, no stray attempt of a committed step
    uploads = boto3.client("s3").list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")
    assert not uploads
    for step in (4, 8):
        got = remote.read_manifest(step)
        assert got is not None
        assert remote.attempts(step) == [got[0].attempt]

    local = run_cli(*base, "run.id=l", "export=none", env=s3_env)  # manifests are compared: no export needed
    assert local.returncode == 0, local.stdout + local.stderr
    local_layout = RunLayout.for_run(tmp_path, "tiny", "l")
    for step in (4, 8):
        assert _hashes_remote(remote, step) == _hashes_local(local_layout, step)

    # a committed step as a foreign DCP checkpoint in the bucket: import.source=s3://... reads it as a directory
    src = f"{prefix}/foreign"
    c = boto3.client("s3")
    for f in (local_layout.committed_step(8)).iterdir():
        if not f.name.endswith(".json"):
            c.upload_file(str(f), bucket, f"{src}/{f.name}")
    source = probe(load_config(["+experiment=tiny", f"run.root={tmp_path}", f"import.source=s3://{bucket}/{src}"]))
    assert (source.format, source.world_size, source.step) == ("torch_dcp", 2, 8)
    assert {n: hash_file(source.root / n) for n in source.files} == {
        n: h for n, (_, h) in _hashes_local(local_layout, 8).items() if n in source.files
    }

    status = subprocess.run(
        [sys.executable, "-m", "pipeline.status", str(layout.run_dir)], capture_output=True, text=True, check=False
    )
    assert status.returncode == 0, status.stderr
    assert f"checkpoints: s3://{bucket}/{prefix}/tiny/k" in status.stdout
    assert "step 8" in status.stdout and "latest" in status.stdout


def test_unreachable_or_unsafe_bucket_is_refused_before_anything_runs(
    tmp_path: Path, s3_env: dict[str, str], bucket: str
) -> None:
    proc = run_cli(
        "+experiment=tiny",
        f"run.root={tmp_path}",
        "run.create=true",
        "checkpoint.storage=s3://no-such-bucket-x/p",
        env=s3_env,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "checkpoint.storage:" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "tiny").exists() or not any((tmp_path / "tiny").iterdir())
    bad = run_cli("+experiment=tiny", f"run.root={tmp_path}", "checkpoint.storage=s3:/x", env=s3_env)
    assert bad.returncode == 2 and "is not an S3 URL" in bad.stderr


def test_status_of_a_bucket_it_cannot_read_exits_1_in_one_line(
    tmp_path: Path, s3_env: dict[str, str], bucket: str
) -> None:
    """Without credentials ``pipeline.status`` must not show the bucket as empty (``committed: none``, exit 0)."""
    from pipeline.checkpoint.stores.stores import record_store
    from pipeline.storage.layout import CheckpointLayout

    layout = CheckpointLayout(tmp_path / "lib")
    layout.checkpoints.mkdir(parents=True)
    record_store(layout, f"s3://{bucket}/lib")  # what Checkpointer(storage=...) records in the dir
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=s3_env["AWS_ENDPOINT_URL"], AWS_CONFIG_FILE="/nonexistent",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent", PIPELINE_S3_ATTEMPTS="1")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "pipeline.status", str(layout.run_dir)], capture_output=True,
                          text=True, env=env, check=False)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"cannot read the checkpoints: cannot list s3://{bucket}/lib" in errors[0], proc.stderr
    with_keys = subprocess.run([sys.executable, "-m", "pipeline.status", str(layout.run_dir)], capture_output=True,
                               text=True, check=False)  # fmt: skip
    assert with_keys.returncode == 0 and "committed: none" in with_keys.stdout, with_keys.stderr
