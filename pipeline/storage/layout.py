"""Paths of a checkpoint directory. Pure functions of the directory: no rank, clock or host ever enters a path."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

_STEP_RE = re.compile(r"^step_(\d+)$")


PRIVATE_UMASK_BITS = 0o022


def restrict_umask() -> None:
    """Never create group- or world-writable files: add 022 to the process umask (``umask 000`` shells too).

    Called by the launching process and by every task before they write anything.
    """
    os.umask(os.umask(0) | PRIVATE_UMASK_BITS)


def step_name(step: int) -> str:
    return f"step_{step}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointLayout:
    """The checkpoint protocol's names under one directory: everything a rank, the committer and a reader need.

    ``<dir>/checkpoints/{staging/step_N, step_N, latest, quarantine}``. The library (a plain ``torchrun`` script's
    :class:`~pipeline.checkpoint.Checkpointer`) uses exactly this; the app's run dir
    (:class:`pipeline.rundir.layout.RunLayout`) adds its own entries (``run.yaml``, records, assets, outputs)
    around the same names, so every reader works on both.
    """

    run_dir: Path

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    @cached_property  # the committer asks for these at every step of its passes
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @cached_property
    def staging(self) -> Path:
        return self.checkpoints / "staging"

    def staged_step(self, step: int) -> Path:
        return self.staging / step_name(step)

    def committed_step(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    @cached_property
    def latest(self) -> Path:
        return self.checkpoints / "latest"

    @property
    def quarantine(self) -> Path:
        return self.checkpoints / "quarantine"

    @property
    def committer_lock(self) -> Path:
        """flock'ed by the one committer of these checkpoints while it runs (never deleted)."""
        return self.checkpoints / ".committer.lock"

    @property
    def metrics(self) -> Path:
        """Per-step metrics (JSON lines), appended by rank 0 across attempts."""
        return self.run_dir / "metrics.jsonl"

    @property
    def consolidated(self) -> Path:
        return self.run_dir / "consolidated"

    def consolidated_step(self, step: int) -> Path:
        return self.consolidated / step_name(step)

    @property
    def export(self) -> Path:
        return self.run_dir / "export"

    def export_step(self, step: int) -> Path:
        return self.export / step_name(step)

    def checkpoint_dirs(self) -> list[Path]:
        """What must exist before any rank saves: created once (idempotent ``mkdir``)."""
        return [self.checkpoints, self.staging, self.quarantine]
