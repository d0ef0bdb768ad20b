"""Time limit and preemption on SLURM: USR2 → every rank saves the same step → rank 0 requeues the job.

SLURM sends USR2 (``--signal=USR2@launcher.signal_delay_s``) to every task before the time limit, or on a
preemption. The handler only sets a flag; train ORs it across ranks after each step (one small all-reduce), so
all ranks agree on the step to stop at, shard-save it, and meet. Then rank 0 alone runs ``scontrol requeue``
and the other tasks exit quietly (no result file for submitit to trip over later). The requeued job reruns the
same pickled call: same attempt, and train resumes from the newest committed step (the committer beside it
commits the step just saved before train decides). ``launcher.max_num_timeout`` bounds the requeues
(``SLURM_RESTART_COUNT``); past it, train saves and stops with an error that says how to continue.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from types import FrameType

from pipeline.config.launcher import SlurmLauncherConfig
from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)

_requested = threading.Event()
_installed = threading.Event()


def install() -> None:
    """Route USR2 to the flag (replacing submitit's handler, which would requeue from task 0 alone)."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        log.warning("received %s: train will save its current step and requeue", signal.Signals(signum).name)
        _requested.set()

    signal.signal(signal.SIGUSR2, handler)
    _installed.set()


def preemptible() -> bool:
    """True in a task that may be preempted (train on SLURM): then train checks the flag after each step."""
    return _installed.is_set()


def preemption_requested() -> bool:
    return _requested.is_set()


def restarts() -> int:
    value = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def no_requeue_reason(cfg: PipelineConfig) -> str | None:
    """Why the job may not requeue itself again, or None."""
    allowed = cfg.launcher.max_num_timeout if isinstance(cfg.launcher, SlurmLauncherConfig) else 0
    if restarts() >= allowed:
        return (
            f"the train job reached its time limit (or was preempted) after {restarts()} requeue(s) and "
            f"launcher.max_num_timeout={allowed} allows no more"
        )
    return None


def requeue(rank: int, job_id: str) -> None:
    """After every rank saved: rank 0 requeues the job; every task then exits without a result."""
    if rank == 0:
        try:
            subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60, capture_output=True, text=True)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or e
            raise PipelineError(f"scontrol requeue {job_id} failed: {' '.join(str(detail).split())}") from None
        log.warning("requeued job %s (restart %d)", job_id, restarts() + 1)
    raise SystemExit(0)
