"""Run single-task stages in the launching process (unit tests). Multi-task stages need real processes."""

from __future__ import annotations

from launchers.base import Launcher
from pipeline.errors import ConfigError
from pipeline.orchestration.runner import StageJob
from pipeline.orchestration.task import execute_task


class InProcessLauncher(Launcher):
    def run_stage(self, job: StageJob) -> None:
        if job.contract.num_tasks(job.cfg) != 1:
            raise ConfigError(
                f"launcher=inprocess cannot run {job.stage} ({job.contract.num_tasks(job.cfg)} tasks): "
                "use launcher=local"
            )
        execute_task(job.stage, job.cfg, str(job.layout.run_dir), job.attempt)
