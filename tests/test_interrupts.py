"""Ctrl-C / SIGTERM to the launching process, and two launches of one run: one owner, no orphans.

The launcher is started in a session of its own, as a shell starts a job in a process group of its own. A
signal sent to its pid alone (``kill <pid>`` from a supervisor) or to its whole process group (a terminal's
Ctrl-C) must have the same effect: the launcher itself cancels the jobs and waits until they are gone, and the
committer commits every completely staged step unless interrupted again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import read_json
from tests.conftest import ROOT, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LONG = ("train.steps=20000", "checkpoint.every=8", "launcher.poll_interval_s=0.2", "launcher.cancel_timeout_s=20")


def _launch(root: Path, run_id: str, *extra: str, faults: str = "") -> subprocess.Popen[str]:
    args = ["+experiment=tiny", f"run.root={root}", f"run.id={run_id}", "run.create=true", *LONG, *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=ROOT,
        env={**os.environ, "PIPELINE_FAULTS": faults} if faults else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # it leads its own process group, as a shell's foreground job does
    )


def _run_processes(layout: RunLayout) -> list[str]:
    """Processes of the run still alive: any whose command line names the run dir (job shells, submitit's
    controllers and tasks: their job folders are under ``logs/``)."""
    found = []
    for p in psutil.process_iter():
        try:
            cmdline = " ".join(p.cmdline())
            if str(layout.run_dir) in cmdline and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid} {cmdline[:160]}")
        except psutil.Error:
            continue
    return found


def _complete_uncommitted(layout: RunLayout, world_size: int = 2) -> list[int]:
    """Steps left in staging with every rank's marker: completely staged, but not committed."""
    steps = []
    for staged in layout.staging.glob("step_*"):
        if all((staged / f"rank_{r}.done.json").exists() for r in range(world_size)):
            steps.append(int(staged.name.removeprefix("step_")))
    return sorted(steps)


def _committed(layout: RunLayout) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in layout.checkpoints.glob("step_*") if p.is_dir())


def _wait_for_staged_checkpoint(layout: RunLayout, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early: {proc.communicate()}")
        if layout.metrics.exists():
            events = [json.loads(line) for line in layout.metrics.read_text().splitlines() if line.endswith("}")]
            if any(e.get("event") == "checkpoint" and e.get("ok") for e in events):
                return
        time.sleep(0.2)
    raise AssertionError("no checkpoint was staged in time")


# SIGTERM to the launcher alone; SIGINT arrives the way a terminal sends it, to the whole process group, in
# test_terminal_ctrl_c_to_the_whole_process_group_still_commits_every_complete_step (same handler, same path).
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_signal_cancels_jobs_commits_staged_steps_and_resumes(tmp_path: Path, sig: signal.Signals) -> None:
    layout = RunLayout.for_run(tmp_path, "tiny", "i")
    proc = _launch(tmp_path, "i")
    _wait_for_staged_checkpoint(layout, proc)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 3, "expected the job controller and two ranks"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)

    assert proc.returncode == 128 + sig, out + err
    assert "Traceback" not in out + err
    survivors = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not survivors, f"processes of the run survived the launcher: {survivors}"
    latest = read_latest(layout)
    assert latest is not None and latest.step >= 8, out
    assert f"interrupted in train; latest = step {latest.step}; resume: python -m pipeline run.id=i" in out
    record = read_json(layout.stage_record("train"))
    assert record["status"] == "interrupted" and record["signal"] == sig.name
    assert not layout.lease.exists(), "the lease is released on the way out"

    # the resume is judged by its train record and latest: it consolidates, and exports nothing (export=none)
    resume = run_cli(f"run.root={tmp_path}", "run.id=i", f"train.stop_after_step={latest.step + 8}", "export=none")
    assert resume.returncode == 0, resume.stdout + resume.stderr
    assert read_json(layout.stage_record("train"))["summary"]["resumed_from"] == latest.step
    assert read_latest(layout).step == latest.step + 8  # type: ignore[union-attr]


def test_two_launches_of_one_run_exactly_one_runs(tmp_path: Path) -> None:
    first, second = _launch(tmp_path, "c"), _launch(tmp_path, "c")
    procs = [first, second]
    deadline = time.monotonic() + 120
    while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    refused = next(p for p in procs if p.poll() is not None)
    owner = second if refused is first else first
    out, err = refused.communicate()
    assert refused.returncode == 2, out + err
    assert "owned by another launch" in err and f"pid {owner.pid}" in err and len(err.strip().splitlines()) == 1
    time.sleep(1.0)
    assert owner.poll() is None, "the owner keeps running"
    owner.send_signal(signal.SIGTERM)
    owner_out, owner_err = owner.communicate(timeout=120)
    assert owner.returncode == 143, owner_out + owner_err
    assert "run c:" in owner_out and "run c:" not in out


def test_terminal_ctrl_c_to_the_whole_process_group_still_commits_every_complete_step(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches every process of the foreground group: the launcher and, unless they are kept
    out of it, the jobs. The committer (slowed down before publishing step 8, so that the interrupt finds it at
    work) must not die of it: it commits every completely staged step, then the launch ends with 130."""
    layout = RunLayout.for_run(tmp_path, "tiny", "g")
    proc = _launch(tmp_path, "g", faults="verify.before_publish@step=8@action=sleep@seconds=3")
    _wait_for_staged_checkpoint(layout, proc)
    os.killpg(proc.pid, signal.SIGINT)  # the whole group, as the terminal sends it
    out, err = proc.communicate(timeout=120)

    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    assert not _run_processes(layout), f"processes of the run survived the launcher: {_run_processes(layout)}"
    latest = read_latest(layout)
    assert latest is not None, f"nothing was committed:\n{out}"
    assert not _complete_uncommitted(layout), f"completely staged steps left uncommitted:\n{out}"
    assert latest.step == max(_committed(layout)) >= 8, out
    for step in _committed(layout):
        verify_committed(layout.committed_step(step), step)
    assert f"interrupted in train; latest = step {latest.step}; resume:" in out


def test_second_ctrl_c_to_the_whole_process_group_cancels_the_committer_too(tmp_path: Path) -> None:
    layout = RunLayout.for_run(tmp_path, "tiny", "h")
    proc = _launch(tmp_path, "h", faults="verify.before_publish@step=8@action=sleep@seconds=120")
    _wait_for_staged_checkpoint(layout, proc)
    os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 60  # the launcher records train as interrupted once its processes are gone
    while time.monotonic() < deadline and read_json(layout.stage_record("train")).get("status") != "interrupted":
        time.sleep(0.2)
    time.sleep(0.5)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=90)

    assert proc.returncode == 130, out + err
    assert time.monotonic() - t0 < 60, "the committer was waited for instead of cancelled"
    assert "skip verify_manifest: interrupted again" in out, out
    assert "Traceback" not in out + err
    assert not _run_processes(layout), f"processes of the run survived the launcher: {_run_processes(layout)}"
    assert 8 in _complete_uncommitted(layout), "step 8 stays staged for the next launch to commit"
