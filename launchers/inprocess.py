"""Run single-task stages in the launching process (tests, debugging). The plan refuses multi-task stages."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from launchers.base import JobHandle, Launcher
from pipeline.driver.supervise import StageJob
from pipeline.driver.task import execute_task


class _Done:
    """A job that ran to its end inside ``submit``; ``outcome`` re-raises its error."""

    def __init__(self, job: StageJob, error: BaseException | None) -> None:
        self.job_id = f"inprocess-{os.getpid()}"
        self.folder: Path = job.layout.logs
        self.error = error

    def poll(self) -> bool:
        return True

    def outcome(self) -> None:
        if self.error is not None:
            raise self.error

    def requeued(self) -> None:
        return None

    def cancel(self, wait: bool = True) -> None:
        pass


class InProcessLauncher(Launcher):
    cluster = "inprocess"

    def submit(self, job: StageJob, after: Sequence[tuple[str, JobHandle]] = ()) -> JobHandle:
        try:
            execute_task(job.stage, job.cfg, str(job.layout.run_dir), job.attempt, beside=job.beside)
        except Exception as e:  # noqa: BLE001 - handed to the runner through outcome(), like a job's result
            return _Done(job, e)
        return _Done(job, None)
