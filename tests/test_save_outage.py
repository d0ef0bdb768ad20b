"""A save that fails on I/O is a failed save, never a crashed job (issue finding: a 5-second filer outage ended
a 2-rank library run with a 40-line traceback from ``PosixCheckpoints.rank_dir``'s mkdir).

The README's script (``examples/readme_train.py``: 40 steps, a save every 10) on 2 CPU ranks, rank 0's staging
dir of step 20 failing with ``EIO`` as a FUSE mount's does while its filer is away: every rank agrees the save
failed (one line each, no traceback), training goes on, the next saves commit, and a crash of the job at that
moment would have lost nothing already committed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.storage.layout import CheckpointLayout

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_staging_dir_that_cannot_be_made_fails_that_save_on_every_rank_and_training_goes_on(
    tmp_path: Path, failing_rank: int
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PIPELINE_FAULTS": f"shard_save.staging_dir@rank={failing_rank}@step=20@action=eio",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / "readme_train.py")]  # fmt: skip
    done = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    failed = [ln for ln in out.splitlines() if "SHARD SAVE FAILED" in ln]
    assert len(failed) == 2 and all("step 20" in ln for ln in failed), failed  # one line per rank
    assert any(f"rank {failing_rank} step 20" in ln and "Input/output error" in ln for ln in failed), failed
    layout = CheckpointLayout(tmp_path / "runs" / "readme")
    latest = read_latest(layout)
    assert latest is not None and latest.step == 40
    verify_committed(layout.committed_step(40), 40)
    quarantine = layout.checkpoints / "quarantine"
    assert not quarantine.exists() or not any(quarantine.iterdir())
