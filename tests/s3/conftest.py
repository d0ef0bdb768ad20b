from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.s3.server import S3Server, seaweedfs


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS per test session (per xdist worker), on loopback."""
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process (and its children) pointed at the server; a fresh client per test."""
    from pipeline.storage import s3  # noqa: PLC0415

    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3._clients.clear()
    return env


@pytest.fixture
def bucket(s3_server: S3Server, s3_env: dict[str, str]) -> str:
    """The session's bucket (a new bucket costs SeaweedFS a volume growth of seconds): tests use their own prefix."""
    return s3_server.bucket


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}/r1"
