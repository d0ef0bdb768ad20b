"""The ``Launcher`` interface: how the runner hands planned stage jobs to whatever runs them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from pipeline.orchestration.runner import JobWatch, StageJob


class JobHandle(Protocol):
    """A submitted stage job."""

    job_id: str
    folder: Path

    def poll(self) -> bool:
        """True once the job has ended. Raises ``StageFailedError`` when the launcher gives up on it (a deadline,
        a task that ended while its peers hang); the runner then cancels it."""
        ...

    def outcome(self) -> None:
        """After ``poll`` said done: return if every task succeeded, else raise ``StageFailedError``."""
        ...

    def cancel(self, wait: bool = True) -> None:
        """Cancel the job and (``wait``) wait, bounded by ``launcher.cancel_timeout_s``, until its processes are
        gone. ``wait=False`` only asks (so several jobs are cancelled at once, before a dependency lets one start)."""
        ...


class Launcher:
    """Submits stage jobs. ``chains`` launchers (SLURM) take every job of a plan at once and let the scheduler
    start each after its dependencies (``after`` names each dependency's kind and handle); the others get a job
    only once its dependencies have ended (or started, for ``after``)."""

    cluster: str = "local"
    chains: bool = False

    def submit(self, job: StageJob, after: Sequence[tuple[str, JobHandle]] = ()) -> JobHandle:
        raise NotImplementedError

    def run_stage(self, job: StageJob, watch: JobWatch) -> None:
        """Submit one job and wait for it (tests and one-off tools; the runner drives handles itself)."""
        handle = self.submit(job)
        try:
            watch.started(handle.job_id, self.cluster, handle.folder)
            while not handle.poll():
                watch.poll()
                time.sleep(job.cfg.launcher.poll_interval_s)
        except BaseException:
            handle.cancel()
            raise
        handle.outcome()
