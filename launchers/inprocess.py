"""Run single-task stages in the launching process (tests, debugging). The plan refuses multi-task stages."""

from __future__ import annotations

import os

from launchers.base import Launcher
from pipeline.orchestration.runner import JobWatch, StageJob
from pipeline.orchestration.task import execute_task


class InProcessLauncher(Launcher):
    def run_stage(self, job: StageJob, watch: JobWatch) -> None:
        watch.started(f"inprocess-{os.getpid()}", "inprocess", job.layout.logs)
        execute_task(job.stage, job.cfg, str(job.layout.run_dir), job.attempt)
