"""What the trainers' tests (Lightning, the HF ``Trainer``, Accelerate) share: their example under torchrun on 2
ranks, a run whose rank 1 is ``kill -9``-ed mid-run and then run again, and what they read back from its output dir
(the losses rank 0 logged, ``latest``'s step, the committed steps, the step a run resumed from)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from pipeline.storage.layout import CheckpointLayout
from tests.conftest import ROOT
from tests.test_examples import LatestWatcher

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::UserWarning"}


def torchrun(example: str, out: Path, *args: str) -> list[str]:
    """``example`` on 2 ranks writing into ``out``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", example,
            "--out", str(out), *args]  # fmt: skip


def run(cmd: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=300, check=False)


def losses(out: Path) -> dict[int, float]:
    """Step -> the loss rank 0 logged last for it (a resumed run logs the steps after its resume step again)."""
    return {e["step"]: e["loss"] for e in map(json.loads, (out / "losses.jsonl").read_text().splitlines())}


def latest_step(out: Path) -> int:
    latest = out / "checkpoints" / "latest"
    return json.loads(latest.read_text())["step"] if latest.exists() else 0


def steps(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))


def resumed_from(stderr: str) -> int:
    """The step named by the run's one "resuming from committed step N" line."""
    lines = [line for line in stderr.splitlines() if "resuming from committed step" in line]
    assert len(lines) == 1, stderr[-3000:]
    return int(lines[0].split("committed step ")[1].split()[0])


@dataclass
class KilledRun:
    again: subprocess.CompletedProcess[str]
    """The relaunch, run to its end."""
    watcher: LatestWatcher
    """What ``latest`` named while both ran (stopped): ``seen``, and ``bad`` (the ones that did not verify)."""
    latest_at_kill: int
    """``latest``'s step once the killed run had ended."""


def kill_rank_1_then_rerun(first: list[str], again: list[str], out: Path, *, at: int = 8, **env: str) -> KilledRun:
    """Start ``first`` (torchrun on 2 ranks writing into ``out``) with ``latest`` polled; once step ``at`` is
    committed, ``kill -9`` rank 1; once the run has failed, run ``again`` to its end."""
    watcher = LatestWatcher(CheckpointLayout(out))
    watcher.start()
    launched = subprocess.Popen(first, cwd=ROOT, env={**ENV, **env}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while latest_step(out) < at and launched.poll() is None:
            assert time.monotonic() < deadline, f"no step {at} committed in 240 s"
            time.sleep(0.05)
        assert launched.poll() is None, f"the run ended before the kill:\n{launched.communicate()[1][-3000:]}"
        rank1 = [p for p in psutil.Process(launched.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        os.kill(rank1[0].pid, signal.SIGKILL)
        assert launched.wait(120) != 0
        killed_at = latest_step(out)
        rerun = run(again, **env)
    finally:
        if launched.poll() is None:
            os.killpg(launched.pid, signal.SIGKILL)
        watcher.halt.set()
        watcher.join(10)
    return KilledRun(rerun, watcher, killed_at)
