"""The shared-filesystem fixture (tests/sharedfs.py): two FUSE clients of one SeaweedFS filer, as on two nodes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import tests.sharedfs as sharedfs_mod
from tests.sharedfs import SharedFS, mounts_under, shared_filesystem, skip_reason

pytest_plugins = ["tests.sharedfs_fixture"]
pytestmark = pytest.mark.xdist_group("sharedfs")


@pytest.fixture
def rel(shared_fs: SharedFS) -> Iterator[str]:
    """A fresh directory of this test's own on the shared filesystem (made through mount 0), as a relative path."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    shared_fs.path(0, name).mkdir()
    yield name


def _publish(path: Path, body: bytes) -> None:
    """Write temp, fsync, rename: how the pipeline publishes a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def _wait_for(path: Path, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not visible in {timeout_s} s"
        time.sleep(0.01)


def test_mounts_are_two_fuse_clients(shared_fs: SharedFS) -> None:
    assert len(shared_fs.mounts) == 2
    assert set(mounts_under(shared_fs.root)) == set(shared_fs.mounts)
    types = {line.split(" - ")[1].split()[0] for line in Path("/proc/self/mountinfo").read_text().splitlines()
             if line.split()[4] in {str(m) for m in shared_fs.mounts}}  # fmt: skip
    assert types == {"fuse.seaweedfs"}
    assert os.stat(shared_fs.mounts[0]).st_dev != os.stat(shared_fs.mounts[1]).st_dev  # two clients, not a bind


def test_published_file_reads_back_through_the_other_mount(shared_fs: SharedFS, rel: str) -> None:
    body = os.urandom(3 * 1024 * 1024 + 17)  # more than one 2 MiB chunk
    _publish(shared_fs.path(0, f"{rel}/data.bin"), body)
    _wait_for(shared_fs.path(1, f"{rel}/data.bin"))
    assert shared_fs.path(1, f"{rel}/data.bin").read_bytes() == body
    assert not shared_fs.path(1, f"{rel}/data.bin.tmp").exists()


def test_flock_is_not_exclusive_across_mounts(shared_fs: SharedFS, rel: str) -> None:
    """Documents the hazard the committer must survive: each FUSE client grants flock on its own."""
    _publish(shared_fs.path(0, f"{rel}/lock"), b"")
    _wait_for(shared_fs.path(1, f"{rel}/lock"))
    fd0 = os.open(shared_fs.path(0, f"{rel}/lock"), os.O_RDWR)
    fd0b = os.open(shared_fs.path(0, f"{rel}/lock"), os.O_RDWR)
    fd1 = os.open(shared_fs.path(1, f"{rel}/lock"), os.O_RDWR)
    try:
        fcntl.flock(fd0, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):  # the same mount: the kernel's lock holds
            fcntl.flock(fd0b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd1, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other mount: GRANTED while mount 0 holds it
    finally:
        for fd in (fd0, fd0b, fd1):
            os.close(fd)


def test_o_excl_sees_a_name_the_other_mount_already_shows(shared_fs: SharedFS, rel: str) -> None:
    """Once the name is visible, O_EXCL through the other mount refuses it (racing creates both win: see
    multinode-probe.md; not asserted here, it is timing-dependent)."""
    fd = os.open(shared_fs.path(0, f"{rel}/owner"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.fsync(fd)
    os.close(fd)
    _wait_for(shared_fs.path(1, f"{rel}/owner"))
    with pytest.raises(FileExistsError):
        os.open(shared_fs.path(1, f"{rel}/owner"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)


def _leftovers(root: Path, pids: list[int]) -> list[str]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and (p.pid in pids or any(str(root) in a for a in p.cmdline())):
                found.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            continue
    return found


def _skip_without_fuse() -> None:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


def test_exit_leaves_no_mount_and_no_process(tmp_path: Path) -> None:
    _skip_without_fuse()
    with shared_filesystem(tmp_path / "sfs") as fs:
        _publish(fs.path(0, "x"), b"x")
        held = open(fs.path(1, "x"), "rb")  # noqa: SIM115 (an open file must not block the teardown)
        assert len(mounts_under(fs.root)) == 2
    with contextlib.suppress(OSError):  # ENOTCONN: its mount was lazily unmounted and its client killed
        held.close()
    assert mounts_under(fs.root) == []
    assert _leftovers(fs.root, fs.pids) == []
    assert len(fs.pids) == 3


def test_failed_start_leaves_no_mount_and_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Server and both mounts up, then the cross-mount check fails: everything started so far is cleaned up."""
    _skip_without_fuse()
    seen: list[SharedFS] = []

    def failing(fs: SharedFS) -> Iterator[bool]:
        seen.append(fs)
        assert set(mounts_under(fs.root)) == set(fs.mounts)
        raise RuntimeError("injected")
        yield False  # a generator, as _visible is

    monkeypatch.setattr(sharedfs_mod, "_visible", failing)
    with pytest.raises(RuntimeError, match="injected"), shared_filesystem(tmp_path / "sfs"):
        pass
    (fs,) = seen
    assert len(fs.pids) == 3
    assert mounts_under(fs.root) == []
    assert _leftovers(fs.root, fs.pids) == []


def test_a_start_up_timeout_names_the_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharedfs_mod, "READY_S", 0.2)
    never = iter(lambda: False, True)
    with pytest.raises(RuntimeError, match=r"sharedfs: FUSE mount /m not ready in 0 s: see /r/log/mount0.log"):
        sharedfs_mod._wait("FUSE mount /m", never, Path("/r/log/mount0.log"), [])
