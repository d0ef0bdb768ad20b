"""The ``Launcher`` base: how the runner hands planned stage jobs to whatever runs them (the runner's side of the
interface, ``JobLauncher`` and ``JobHandle``, is in :mod:`pipeline.driver.supervise`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from pipeline.driver.supervise import JobHandle, JobWatch, StageJob


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
