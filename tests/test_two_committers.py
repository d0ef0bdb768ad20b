"""The committer where the shared filesystem gives no lock: two FUSE mounts of one SeaweedFS filer (the way two
nodes mount a shared filesystem), on which ``flock``, ``O_EXCL`` and ``link`` exclude nothing across mounts.

Each committer here works through its own mount. Exclusion comes from the committer lease (a heartbeat and a
fencing epoch); everything a second or stale committer can still do must be harmless.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer
from pipeline.checkpoint.protocol.ownership import LEASE, FileLease, Holder, newest_holder
from pipeline.checkpoint.stores.repair import step_entries
from pipeline.storage.backend import POSIX
from tests import contention
from tests.conftest import ROOT
from tests.sharedfs import SharedFS

pytest_plugins = ["tests.sharedfs_fixture"]  # the session's two mounts (one instance with tests/test_sharedfs.py)
pytestmark = pytest.mark.xdist_group("sharedfs")

TRIALS = 20
"""In the suite; ``python -m tests.contention --trials 200`` is the stress run (``--unleased``: see there)."""


def test_two_committers_started_together_publish_each_step_once(shared_fs: SharedFS) -> None:
    failures = {i: p for i in range(TRIALS) if (p := contention.trial(shared_fs, leased=True))}
    assert not failures, f"{len(failures)} of {TRIALS} trials failed: {failures}"


def test_ranks_write_through_one_mount_committer_verifies_through_the_other(shared_fs: SharedFS) -> None:
    writer, reader = contention.layouts(shared_fs, "follow")
    contention.stage(writer, ())
    contention.wait_visible(reader.staging)
    committer = Committer(reader, CommitPolicy(world_size=2, poll_interval_s=0.05, marker_deadline_s=10.0))
    producing = threading.Event()
    producing.set()
    with committer.hold():
        follower = threading.Thread(target=committer.follow, kwargs={"alive": producing.is_set})
        follower.start()
        for step in range(1, 7):
            contention.stage(writer, (step,))
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while committer.latest_step() < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        producing.clear()
        follower.join(30)
    assert sorted(committer.report.committed) == [1, 2, 3, 4, 5, 6]
    assert read_latest(writer).step == 6  # type: ignore[union-attr]
    assert [s for s, _ in step_entries(POSIX, writer.checkpoints)] == [1, 2, 3, 4, 5, 6]


def _commit(layout_dir: Path, *args: str) -> subprocess.Popen[str]:
    """``python -m pipeline.commit`` (for the tests' fake format), as an operator runs it."""
    cmd = [sys.executable, "-m", "tests.commit_cli", str(layout_dir), "--world-size", "2", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(what: str, cond: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _holder(layout: contention.RunLayout) -> Holder | None:
    return newest_holder(FileLease(layout.checkpoints / LEASE))


def _epoch(layout: contention.RunLayout) -> int:
    held = _holder(layout)
    return held.epoch if held else 0


def _latest(layout: contention.RunLayout) -> int:
    found = read_latest(layout)
    return found.step if found else 0


def test_second_commit_beside_a_live_committer_on_another_mount_is_refused(shared_fs: SharedFS) -> None:
    a, b = contention.layouts(shared_fs, "refuse")
    contention.stage(a, (2,))
    first = _commit(a.run_dir, "--follow", "--interval", "0.2")
    try:
        _wait("the first committer's lease, seen through the other mount", lambda: _holder(b) is not None)
        _wait("step 2 committed", lambda: _latest(b) == 2)
        second = subprocess.run(
            [sys.executable, "-m", "tests.commit_cli", str(b.run_dir), "--world-size", "2"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: another committer holds"), second.stderr
        assert f"pid {first.pid} on " in lines[0] and "epoch 1" in lines[0], lines[0]
        assert first.poll() is None, "the live committer must go on"
        status = subprocess.run(
            [sys.executable, "-m", "pipeline.status", str(b.run_dir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert f"committer:  running: pid {first.pid} on " in status.stdout, status.stdout + status.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert _holder(b).released  # type: ignore[union-attr]


def test_a_committer_stopped_past_its_lease_is_fenced_and_harmless(shared_fs: SharedFS) -> None:
    a, b = contention.layouts(shared_fs, "ghost")
    contention.stage(a, (2,))
    ghost = _commit(a.run_dir, "--follow", "--interval", "0.2", "--lease", "2")
    live: subprocess.Popen[str] | None = None
    try:
        _wait("step 2 committed by the first committer", lambda: _latest(b) == 2)
        os.kill(ghost.pid, signal.SIGSTOP)  # a partition, a frozen node: its heartbeat stops
        contention.stage(a, (4,))  # staged while nobody commits
        time.sleep(2.5)  # past its lease
        live = _commit(b.run_dir, "--follow", "--interval", "0.2", "--lease", "2")
        _wait("the second committer's lease (epoch 2)", lambda: _epoch(a) == 2)
        _wait("step 4 committed by the second committer", lambda: _latest(a) == 4)
        contention.stage(a, (6,))
        os.kill(ghost.pid, signal.SIGCONT)  # the ghost comes back, with a stale view
        contention.stage(a, (8,))
        _, ghost_err = ghost.communicate(timeout=60)
        _wait("step 8 committed by the second committer", lambda: _latest(a) == 8)
    finally:
        for p in (ghost, live):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
                p.communicate(timeout=60)
    assert ghost.returncode == 1, ghost_err
    stopped = [line for line in ghost_err.splitlines() if "lost" in line]
    assert len(stopped) == 1 and stopped[0].startswith("stopped: this committer (epoch 1"), ghost_err
    assert "epoch 2" in stopped[0] and "it stops and commits nothing more" in stopped[0], stopped[0]
    assert live is not None and live.returncode == 0
    published = {s: read_manifest(p).attempt for s, p in step_entries(POSIX, a.checkpoints)}
    assert published == dict.fromkeys((2, 4, 6, 8), contention.ATTEMPT), "the ghost deleted or replaced a step"
    assert not POSIX.list(a.quarantine), "the ghost quarantined a step"
    assert _epoch(a) == 2
