"""What the trainers' tests (Lightning, Accelerate) share: their example under torchrun on 2 ranks, and what they
read back from its output dir (the losses rank 0 logged, ``latest``'s step, the committed steps, the step a run
resumed from)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

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
