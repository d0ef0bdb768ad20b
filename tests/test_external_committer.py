"""A library job with ``committer="external"``: ``close()`` waits, bounded, for a committer to commit the steps the
job saved, and names those nobody committed (kept in staging for ``python -m pipeline.commit``)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.checkpoint import Checkpointer
from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.storage.backend import held_elsewhere
from pipeline.storage.layout import CheckpointLayout
from tests.conftest import ROOT

LOGGER = "pipeline.checkpoint.checkpointer"


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def _commit(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipeline.commit", str(directory), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def test_steps_nobody_committed_are_named_and_a_later_commit_publishes_them(
    one_rank: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = CheckpointLayout(tmp_path)
    state = _state()
    ck = Checkpointer(tmp_path, committer="external", deadline_s=30, external_commit_wait_s=0.5)
    assert ck.save(4, state).ok and ck.save(8, state).ok
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ck.close()
    assert time.monotonic() - t0 < 10, "close waits external_commit_wait_s with no committer, not deadline_s"
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert warnings == [
        f"steps 4, 8 staged in {layout.checkpoints} were not committed: no committer ran "
        f"(start `python -m pipeline.commit {tmp_path}`); they are kept in staging"
    ], warnings
    assert layout.staged_step(4).is_dir() and layout.staged_step(8).is_dir() and read_latest(layout) is None

    done = _commit(tmp_path)
    assert done.returncode == 0, done.stderr
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    for step in (4, 8):
        verify_committed(layout.committed_step(step), step)


def test_close_waits_for_a_running_committer_to_commit_the_last_step(
    one_rank: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = CheckpointLayout(tmp_path)
    state = _state()
    ck = Checkpointer(tmp_path, committer="external", deadline_s=60, external_commit_wait_s=30)
    follow = subprocess.Popen(
        [sys.executable, "-m", "pipeline.commit", str(tmp_path), "--follow", "--interval", "0.1"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not held_elsewhere(layout.committer_lock):  # the committer is up
            assert follow.poll() is None and time.monotonic() < deadline, "the committer did not start"
            time.sleep(0.1)
        assert ck.save(4, state).ok and ck.save(8, state).ok
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            ck.close()
        # close returned once the committer had committed what the job saved: nothing left to name
        assert read_latest(layout).step == 8  # type: ignore[union-attr]
        assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    finally:
        follow.terminate()
        follow.wait(60)
