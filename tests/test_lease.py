"""The run lease: one launch owns a run at a time; stale leases are broken only when the owner is provably gone."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.driver.lease import RunLease, read_lease
from pipeline.errors import RunBusyError
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import create_exclusive

ROOT = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()

# A launch in another process: wait for the go file, try to take the lease, report, then hold it until told.
RACER = """
import sys, time
from pathlib import Path
from pipeline.errors import RunBusyError
from pipeline.driver.lease import RunLease
from pipeline.rundir.layout import RunLayout
run_dir, go, release = map(Path, sys.argv[1:4])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
try:
    lease = RunLease.acquire(RunLayout(run_dir), command=["racer"], say=lambda m: None)
except RunBusyError:
    print("busy", flush=True)
    sys.exit(0)
print("won", flush=True)
while not release.exists():
    time.sleep(0.01)
lease.release()
"""

# A launch that takes the lease and dies without releasing it.
CRASHER = """
import os, sys
from pathlib import Path
from pipeline.driver.lease import RunLease
from pipeline.rundir.layout import RunLayout
RunLease.acquire(RunLayout(Path(sys.argv[1])), command=["crasher"])
os._exit(0)
"""


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    run = RunLayout(tmp_path / "tiny" / "run1")
    run.run_dir.mkdir(parents=True)
    return run


def _python(code: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: a zombie would still answer kill(pid, 0)
    return proc.pid


def _write_lease(layout: RunLayout, *, host: str, pid: int, jobs: list[dict[str, str]]) -> dict[str, object]:
    lease: dict[str, object] = {
        "host": host,
        "pid": pid,
        "started": "2024-01-01T00:00:00Z",
        "launch_id": "feedfacefeedface",
        "command": ["python", "-m", "pipeline", "+experiment=tiny"],
        "jobs": jobs,
    }
    layout.lease.write_text(json.dumps(lease))
    return lease


def _job(job_id: str, cluster: str, host: str = HOST) -> dict[str, str]:
    return {"stage": "train", "job_id": job_id, "cluster": cluster, "host": host}


def test_acquire_and_release_round_trip(layout: RunLayout) -> None:
    lease = RunLease.acquire(layout, command=["python", "-m", "pipeline"])
    on_disk = read_lease(layout)
    assert on_disk is not None
    assert (on_disk["host"], on_disk["pid"], on_disk["command"], on_disk["jobs"]) == (
        HOST,
        os.getpid(),
        ["python", "-m", "pipeline"],
        [],
    )
    assert on_disk["launch_id"] == lease.launch_id and on_disk["started"].endswith("Z")
    lease.release()
    assert read_lease(layout) is None and not layout.lease.exists()
    lease.release()  # idempotent
    with RunLease.acquire(layout, command=["again"]):
        assert layout.lease.exists()
    assert not layout.lease.exists()
    assert sorted(p.name for p in layout.run_dir.iterdir()) == [".lease.lock"]  # no temp files left


def test_second_launch_refuses_in_one_line_naming_the_owner(layout: RunLayout) -> None:
    with RunLease.acquire(layout, command=["python", "-m", "pipeline", "run.id=run1"]) as held:
        with pytest.raises(RunBusyError) as err:
            RunLease.acquire(layout, command=["second"])
        message = str(err.value)
        assert f"pid {os.getpid()} on {HOST}" in message and "run.id=run1" in message
        assert message.startswith(f"run {layout.run_id} is owned by another launch")
        assert str(layout.lease) in message and "\n" not in message and err.value.exit_code == 2
        on_disk = read_lease(layout)
        assert on_disk is not None and on_disk["launch_id"] == held.launch_id


def test_racing_processes_exactly_one_wins(layout: RunLayout, tmp_path: Path) -> None:
    for round_ in range(4):
        go, release = tmp_path / f"go{round_}", tmp_path / f"release{round_}"
        procs = [_python(RACER, layout.run_dir, go, release) for _ in range(4)]
        try:
            assert all(p.stdout is not None and p.stdout.readline().strip() == "ready" for p in procs)
            go.touch()
            results = sorted(p.stdout.readline().strip() for p in procs if p.stdout is not None)
            assert results == ["busy", "busy", "busy", "won"], f"round {round_}: {results}"
        finally:
            release.touch()
            for p in procs:
                assert p.wait(timeout=30) == 0
        assert read_lease(layout) is None


def test_lease_of_a_dead_launch_is_broken_and_kept(layout: RunLayout) -> None:
    crasher = _python(CRASHER, layout.run_dir)
    assert crasher.wait(timeout=30) == 0
    stale = read_lease(layout)
    assert stale is not None and stale["pid"] == crasher.pid
    said: list[str] = []
    with RunLease.acquire(layout, command=["new"], say=said.append) as lease:
        assert len(said) == 1
        assert said[0].startswith(f"broke stale lease of {HOST}:{crasher.pid} (started {stale['started']}): ")
        assert f"pid {crasher.pid} is not running" in said[0]
        kept = list(layout.broken_leases.iterdir())
        assert len(kept) == 1 and str(kept[0]) in said[0]
        assert json.loads(kept[0].read_text())["launch_id"] == stale["launch_id"]
        current = read_lease(layout)
        assert current is not None and current["launch_id"] == lease.launch_id and current["pid"] == os.getpid()


def test_a_lease_handed_to_slurm_jobs_is_taken_over_once_they_ended(layout: RunLayout) -> None:
    """A SLURM launch that left the run to its jobs ended normally: the next launch takes the run over (keeping
    the old lease) and says so, without calling it a stale lease."""
    first = RunLease.acquire(layout, command=["first"], say=pytest.fail)
    first.record_job("train", "4242", "slurm")
    first.hand_over()
    first.release()  # the with-block's exit after a hand-over: the lease stays
    handed = read_lease(layout)
    assert handed is not None and isinstance(handed["handed_over"], str) and handed["jobs"][0]["job_id"] == "4242"
    layout.lease.write_text(json.dumps({**handed, "pid": _dead_pid()}))  # the launching process has exited
    with pytest.raises(RunBusyError, match="4242 may still be queued or running"):
        RunLease.acquire(layout, command=["new"], job_state=lambda c, j: True)
    said: list[str] = []
    RunLease.acquire(layout, command=["new"], say=said.append, job_state=lambda c, j: False).release()
    assert len(said) == 1 and said[0].startswith(f"took the run over from launch {HOST}:"), said
    assert "which left it to its jobs" in said[0] and "4242 (slurm) finished" in said[0] and "stale" not in said[0]
    assert len(list(layout.broken_leases.iterdir())) == 1


def test_live_local_job_keeps_the_lease_until_it_ends(layout: RunLayout) -> None:
    job = subprocess.Popen(["sleep", "30"])
    try:
        _write_lease(layout, host=HOST, pid=_dead_pid(), jobs=[_job(str(job.pid), "local")])
        with pytest.raises(
            RunBusyError,
            match=f"owned by another launch: pid .* its jobs {job.pid} may still be queued or running.*kill {job.pid}",
        ):
            RunLease.acquire(layout, command=["new"], say=pytest.fail)
    finally:
        job.kill()
        job.wait()
    said: list[str] = []
    RunLease.acquire(layout, command=["new"], say=said.append).release()
    assert len(said) == 1 and f"jobs {job.pid} (local) finished" in said[0]


def test_inprocess_job_without_pid_lives_and_dies_with_its_launch(layout: RunLayout) -> None:
    _write_lease(layout, host=HOST, pid=os.getpid(), jobs=[_job("inprocess", "inprocess")])
    with pytest.raises(RunBusyError):
        RunLease.acquire(layout, command=["new"])
    _write_lease(layout, host=HOST, pid=_dead_pid(), jobs=[_job("inprocess", "inprocess")])
    RunLease.acquire(layout, command=["new"], say=lambda m: None).release()


def test_lease_on_another_host_needs_the_scheduler_to_say_finished(layout: RunLayout) -> None:
    jobs = [_job("4242", "slurm", host="node7"), _job("4243", "slurm", host="node8")]
    _write_lease(layout, host="elsewhere.invalid", pid=_dead_pid(), jobs=jobs)
    asked: list[tuple[str, str]] = []
    for answer in (None, True):
        with pytest.raises(RunBusyError, match="pid .* on elsewhere.invalid"):
            RunLease.acquire(layout, command=["new"], job_state=lambda c, j, a=answer: asked.append((c, j)) or a)
    with pytest.raises(RunBusyError):  # no scheduler to ask: unknown counts as alive
        RunLease.acquire(layout, command=["new"])
    with pytest.raises(RunBusyError):  # one job finished, one unknown
        RunLease.acquire(layout, command=["new"], job_state=lambda c, j: False if j == "4242" else None)
    assert ("slurm", "4242") in asked
    said: list[str] = []
    RunLease.acquire(layout, command=["new"], say=said.append, job_state=lambda c, j: False).release()
    assert len(said) == 1 and "elsewhere.invalid" in said[0] and "4242 (slurm), 4243 (slurm) finished" in said[0]


def test_lease_on_another_host_without_jobs_is_never_broken(layout: RunLayout) -> None:
    _write_lease(layout, host="elsewhere.invalid", pid=_dead_pid(), jobs=[])
    with pytest.raises(RunBusyError):
        RunLease.acquire(layout, command=["new"], job_state=lambda c, j: False)
    assert layout.lease.exists()


def test_symlinked_lease_is_refused_not_followed(layout: RunLayout, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    _write_lease(layout, host=HOST, pid=_dead_pid(), jobs=[])  # stale: would be broken if followed
    layout.lease.rename(target)
    layout.lease.symlink_to(target)
    before = target.read_bytes()
    with pytest.raises(RunBusyError, match="is a symlink, which is never followed") as err:
        RunLease.acquire(layout, command=["new"])
    assert str(layout.lease) in str(err.value)
    assert layout.lease.is_symlink() and target.read_bytes() == before
    with pytest.raises(RunBusyError, match="is a symlink"):
        read_lease(layout)


@pytest.mark.parametrize("content", ["{not json", '{"host": "h", "pid": 12}', "[]", '{"host": "h", "pid": -1}'])
def test_malformed_lease_is_refused_not_broken(layout: RunLayout, content: str) -> None:
    layout.lease.write_text(content)
    with pytest.raises(RunBusyError) as err:
        RunLease.acquire(layout, command=["new"])
    message = str(err.value)
    assert str(layout.lease) in message and "remove it" in message and "\n" not in message
    assert "its owner is unknown" in message
    assert layout.lease.read_text() == content


def test_record_job_rewrites_the_lease(layout: RunLayout) -> None:
    with RunLease.acquire(layout, command=["launch"]) as lease:
        lease.record_job("prepare_dirs", "1234", "local")
        lease.record_job("train", "98765", "slurm")
        on_disk = json.loads(layout.lease.read_text())
        assert on_disk["launch_id"] == lease.launch_id
        assert on_disk["jobs"] == [
            {"stage": "prepare_dirs", "job_id": "1234", "cluster": "local", "host": HOST},
            {"stage": "train", "job_id": "98765", "cluster": "slurm", "host": HOST},
        ]


def test_a_lost_lease_is_neither_updated_nor_removed(layout: RunLayout) -> None:
    lease = RunLease.acquire(layout, command=["launch"])
    other = _write_lease(layout, host="elsewhere.invalid", pid=1, jobs=[])  # taken over behind our back
    with pytest.raises(RunBusyError, match="no longer holds"):
        lease.record_job("train", "1", "local")
    lease.release()
    assert json.loads(layout.lease.read_text()) == other


def test_lock_wait_is_bounded(layout: RunLayout) -> None:
    with open(layout.lease_lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        with pytest.raises(RunBusyError, match="could not lock") as err:
            RunLease.acquire(layout, command=["new"], lock_timeout_s=0.2)
        assert str(layout.lease_lock) in str(err.value) and time.monotonic() - t0 < 5
    assert not layout.lease.exists()


def test_create_exclusive_never_replaces(tmp_path: Path) -> None:
    path = tmp_path / "claim.json"
    assert create_exclusive(path, b"first")
    assert not create_exclusive(path, b"second")
    assert path.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["claim.json"]
