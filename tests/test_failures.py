"""A failed stage is one line naming its root cause: the task that failed first with its own error (not a
peer's gloo error), then the path of that task's log; and a full disk is said as such, not as a traceback."""

from __future__ import annotations

import dataclasses
import errno
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from launchers import task_outcomes
from launchers.submitit_launcher import SubmititHandle, SubmititLauncher
from launchers.task_outcomes import TaskOutcome, failure_message, outcomes
from pipeline.config.compose import load_config
from pipeline.driver.runner import StageJob
from pipeline.driver.task import failure_line, parse_failure_line
from pipeline.errors import ConfigError, StageFailedError
from pipeline.rundir.layout import RunLayout
from pipeline.stages import get_stage
from tests.conftest import run_cli

GLOO = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
FRAME = re.compile(r'^\s*(\[rank\d\]:\s*)?File "', re.MULTILINE)


def _task(task: int, status: str, at: float, error: str = "") -> TaskOutcome:
    return TaskOutcome(task, status, at, error, Path(f"/logs/7_{task}_log.err"))


def test_failure_line_round_trips() -> None:
    line = failure_line(3, ValueError("bad\n  value"), 1700000000.25)
    assert line == "TASK FAILED rank 3 at 1700000000.250: ValueError: bad value"
    assert parse_failure_line(f"[rank3]: {line}\n") == (3, 1700000000.25, "ValueError: bad value")
    assert parse_failure_line("2026-01-01 [rank 0] step 3 loss 1.0") is None
    # DCP's CheckpointException carries every rank's traceback in its message: the error that ended the first
    embedded = 'ranks:dict_keys([0, 1])\nTraceback (most recent call last): (RANK 0)\n  File "x.py"\nOSError: full\n'
    line = failure_line(0, RuntimeError(embedded + embedded.replace("RANK 0", "RANK 1")), 5.0)
    assert line == "TASK FAILED rank 0 at 5.000: RuntimeError: ranks:dict_keys([0, 1]) (caused by OSError: full)"


def test_root_cause_is_the_first_error_that_is_not_a_peers_side_effect() -> None:
    tasks = [_task(0, "failed", 10.0, GLOO), _task(1, "failed", 11.0, "InjectedFault: injected fault at x")]
    msg = failure_message("train", "7", tasks, Path("/"))
    assert msg.startswith("stage train failed (job 7): rank 1 failed first: InjectedFault: injected fault at x;")
    assert "then rank 0 failed too" in msg and "gloo" not in msg and msg.endswith("log: /logs/7_1_log.err")
    assert "\n" not in msg
    both_own = [_task(0, "failed", 12.0, "ValueError: a"), _task(1, "failed", 11.0, "OSError: b")]
    assert "rank 1 failed first: OSError: b" in failure_message("train", "7", both_own, Path("/"))


def test_a_killed_rank_is_named_with_how_it_died() -> None:
    tasks = [_task(0, "failed", 10.0, GLOO), _task(1, "died", 10.5)]
    msg = failure_message("train", "7", tasks, Path("/"))
    assert "rank 1 died first without a result or a Python error (killed by a signal, e.g. SIGKILL" in msg
    assert msg.endswith("log: /logs/7_1_log.err")


def test_a_stuck_peer_is_named_when_the_rank_that_ended_only_timed_out() -> None:
    tasks = [_task(0, "failed", 10.0, "RuntimeError: [gloo] Timed out waiting 10000ms"), _task(1, "running", 1e99)]
    msg = failure_message("train", "7", tasks, Path("/"), states={1: "stopped"}, grace_s=5)
    assert "rank 1 (stopped) stopped responding: rank 0 failed waiting for it: RuntimeError" in msg
    assert "cancelled after launcher.peer_grace_s=5s" in msg and msg.endswith("log: /logs/7_0_log.err")
    finished = [_task(0, "succeeded", 10.0), _task(1, "running", 1e99)]
    msg = failure_message("train", "7", finished, Path("/"), states={1: "blocked in I/O"}, grace_s=5)
    assert "rank 0 finished but rank 1 (blocked in I/O) did not end within launcher.peer_grace_s=5s" in msg


def test_outcomes_read_failure_lines_result_pickles_and_tracebacks(tmp_path: Path) -> None:
    logs = {
        0: f"[rank0]: Traceback (most recent call last):\n[rank0]: {GLOO}\n{failure_line(0, RuntimeError('x'), 9.0)}\n",
        1: "step 1\n" + failure_line(1, KeyError("k"), 8.0) + "\nTraceback...\nKeyError: 'k'\n",
        2: 'Traceback (most recent call last):\n  File "x.py", line 1\nOSError: [Errno 28] No space left on device\n',
        3: "2026-01-01 [rank 3] step 3\n",
        4: "write failed: [Errno 28] No space left on device\n" + failure_line(4, RuntimeError("bad pos"), 7.0) + "\n",
    }
    paths = {}
    for task, text in logs.items():
        (tmp_path / f"{task}.err").write_text(text)
        paths[task] = SimpleNamespace(stderr=tmp_path / f"{task}.err", result_pickle=tmp_path / f"{task}.pkl")
    sjob = SimpleNamespace(task=lambda i: SimpleNamespace(paths=paths[i]))
    got = {t.task: (t.status, t.error) for t in outcomes(sjob, 5)}
    assert got == {
        0: ("failed", "RuntimeError: x"),
        1: ("failed", "KeyError: 'k'"),
        2: ("failed", "OSError: [Errno 28] No space left on device"),
        3: ("died", ""),
        4: ("failed", "RuntimeError: bad pos (No space left on device in its log)"),  # a wrapped ENOSPC
    }


def test_a_full_filesystem_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(task_outcomes, "free_space", lambda _path: (Path("/mnt/small"), 0))
    msg = failure_message("consolidate", "7", [_task(0, "died", 1.0)], Path("/mnt/small/logs"))
    assert "its task died without a result" in msg
    assert "No space left on device on /mnt/small (0 B free): free space on it or choose another run.root" in msg


def test_peer_grace_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"launcher.peer_grace_s=0.0 must be > 0"):
        load_config(["+experiment=tiny", f"run.root={tmp_path}", "launcher.peer_grace_s=0"])


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_failure_is_one_line_naming_that_rank_and_its_log(tmp_path: Path) -> None:
    """Rank 1 raises in shard-save; rank 0 then fails in a collective. The line names rank 1's error."""
    fault = {"PIPELINE_FAULTS": "shard_save.before_marker@rank=1@step=4"}
    proc = run_cli(
        "+experiment=tiny",
        f"run.root={tmp_path}",
        "run.id=f",
        "run.create=true",
        "checkpoint.fail_on_save_error=true",
        "launcher.poll_interval_s=0.2",
        env=fault,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    error = proc.stderr.strip()
    head = "error: stage train failed (job "
    assert error.startswith(head) and "rank 1 failed first: InjectedFault: injected fault at shard_save" in error
    assert "then rank 0 failed too" in error and "gloo" not in error and "Connection closed" not in error
    assert not FRAME.search(proc.stdout + proc.stderr) and "Traceback" not in proc.stdout + proc.stderr
    log = Path(error.rsplit("; log: ", 1)[1])
    assert log.is_file() and log.parent.parent == RunLayout.for_run(tmp_path, "tiny", "f").logs / "train"
    text = log.read_text()
    assert "TASK FAILED rank 1 at " in text and "Traceback" in text, "the traceback belongs in the log"
    assert f"FAIL train: {error.removeprefix('error: ')}" in proc.stdout


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs (needs the right to mount: root, or skip)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    try:
        cmd = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]
        done = subprocess.run(cmd, capture_output=True, check=False)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(directory: Path) -> None:
    with (directory / "filler").open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


class _Watch:
    def started(self, job_id: str, cluster: str, folder: Path) -> None:
        raise AssertionError("nothing may start on a full disk")

    def poll(self) -> None:
        pass


def test_submit_on_a_full_disk_is_one_line(small_fs: Path) -> None:
    cfg = load_config(["+experiment=tiny", f"run.root={small_fs}", "run.id=full"])
    layout = RunLayout.for_run(small_fs, "tiny", "full")
    layout.logs.mkdir(parents=True)
    _fill(small_fs)
    contract = get_stage("prepare_dirs").CONTRACT
    job = StageJob("prepare_dirs", contract, cfg, layout, "a1", 1, contract.resources_for(cfg))
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(StageFailedError) as excinfo:
        SubmititLauncher(cfg.launcher, cluster="local").run_stage(job, _Watch())
    msg = str(excinfo.value)
    assert msg.startswith("cannot submit stage prepare_dirs: No space left on device writing "), msg
    assert f"free space on {small_fs} (" in msg and "or choose another run.root" in msg and "\n" not in msg
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children, "nothing was left running"
    assert not list((layout.logs / "prepare_dirs").glob("*.pkl")), "the partial job pickle is removed"


@pytest.mark.slow
@pytest.mark.distributed
def test_train_on_a_disk_that_fills_up_says_so(small_fs: Path) -> None:
    """Step 8 does not fit: train fails with ENOSPC (its cause said, or the full filesystem named), and the
    stages after it cannot be submitted: one line each, no traceback."""
    proc = run_cli(
        "+experiment=tiny",
        f"run.root={small_fs}",
        "run.id=full",
        "run.create=true",
        "checkpoint.fail_on_save_error=true",
        "launcher.poll_interval_s=0.2",
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Traceback" not in out and not FRAME.search(out), out
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    train = next(line for line in proc.stdout.splitlines() if line.startswith("FAIL train"))
    assert "No space left on device" in train, train
    assert "log: " in train


class _NeverDone:
    """A submitit job that never ends (what the launcher sees of a job that hangs)."""

    job_id = "4242"
    paths = SimpleNamespace(folder=Path("/logs/4242"))

    def done(self) -> bool:
        return False


def test_job_past_its_time_limit_is_cancelled(tmp_path: Path) -> None:
    """The job deadline is the stage's time limit plus ``launcher.deadline_grace_s``; past it, one line."""
    cfg = load_config(["+experiment=tiny", f"run.root={tmp_path}", "launcher.deadline_grace_s=0.3"])
    contract = get_stage("consolidate").CONTRACT
    resources = dataclasses.replace(contract.resources_for(cfg), timeout_min=0)
    job = StageJob("consolidate", contract, cfg, RunLayout(tmp_path / "r"), "a1", 1, resources)
    handle = SubmititHandle(SubmititLauncher(cfg.launcher, cluster="local"), _NeverDone(), job)
    assert handle.poll() is False
    time.sleep(0.4)
    with pytest.raises(StageFailedError, match=r"ran past its time limit of 0 min \+ launcher.deadline_grace_s=0.3s"):
        handle.poll()
