"""Ctrl-C / SIGTERM to the launching process, and two launches of one run: one owner, no orphans.

The launcher is started in a session of its own, so a signal reaches only its pid (like ``kill <pid>`` from a
supervisor), not the job processes: the launcher itself must cancel them and wait until they are gone.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.checkpoint.manifest import read_latest
from pipeline.storage.atomic import read_json
from pipeline.storage.layout import RunLayout
from tests.conftest import ROOT, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LONG = ("train.steps=20000", "checkpoint.every=8", "launcher.poll_interval_s=0.2", "launcher.cancel_timeout_s=20")


def _launch(root: Path, run_id: str, *extra: str) -> subprocess.Popen[str]:
    args = ["+experiment=tiny", f"run.root={root}", f"run.id={run_id}", "run.create=true", *LONG, *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
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

    resume = run_cli(f"run.root={tmp_path}", "run.id=i", f"train.stop_after_step={latest.step + 8}")
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
