"""Launch each stage as a submitit job (local executor, or SLURM) and wait for it with a deadline."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import submitit

from launchers.base import Launcher
from launchers.resources import submitit_parameters
from pipeline.config.schema import LauncherConfig, LocalLauncherConfig, PipelineConfig
from pipeline.errors import StageFailedError
from pipeline.orchestration.runner import StageJob
from pipeline.orchestration.task import execute_task


def task_entry(stage: str, cfg: PipelineConfig, run_dir: str, attempt: str) -> dict[str, object]:
    """Runs in every task of a job: join the job's process group environment, then run the stage."""
    env = submitit.JobEnvironment()
    if env.num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        if isinstance(cfg.launcher, LocalLauncherConfig):
            os.environ["MASTER_ADDR"] = cfg.launcher.master_addr  # a literal IP: no hostname lookup at rendezvous
    return execute_task(
        stage, cfg, run_dir, attempt, rank=env.global_rank, world_size=env.num_tasks, job_id=str(env.job_id)
    )


def _tail(path: Path | None, lines: int = 15) -> str:
    if path is None or not Path(path).exists():
        return "(no log)"
    text = Path(path).read_text(errors="replace").strip().splitlines()
    return "\n".join(text[-lines:])


class SubmititLauncher(Launcher):
    def __init__(self, launcher: LauncherConfig, cluster: str) -> None:
        self.cfg = launcher
        self.cluster = cluster

    def run_stage(self, job: StageJob) -> None:
        folder = job.layout.logs / job.stage / "%j"
        executor = submitit.AutoExecutor(folder=folder, cluster=self.cluster)
        executor.update_parameters(
            **submitit_parameters(job.contract, job.contract.num_tasks(job.cfg), self.cfg, job.layout.run_id)
        )
        sjob = executor.submit(task_entry, job.stage, job.cfg, str(job.layout.run_dir), job.attempt)
        self._wait(sjob, job)

    def _wait(self, sjob: Any, job: StageJob) -> None:
        deadline = time.monotonic() + self.cfg.job_deadline_s
        while not sjob.done():
            if time.monotonic() > deadline:
                sjob.cancel(check=False)
                raise StageFailedError(
                    f"stage {job.stage} (job {sjob.job_id}) ran past "
                    f"launcher.job_deadline_s={self.cfg.job_deadline_s:g}s "
                    f"and was cancelled; logs: {sjob.paths.folder}"
                )
            time.sleep(self.cfg.poll_interval_s)
        reasons: list[str] = []
        first_failed: int | None = None
        for task in range(job.contract.num_tasks(job.cfg)):
            try:
                sjob.task(task).result()
            except Exception as e:  # submitit raises FailedJobError / UncompletedJobError with the traceback text
                first_failed = task if first_failed is None else first_failed
                reasons.append(f"task {task}: {_reason(sjob.task(task).paths.stderr, e)}")
        if first_failed is not None:
            paths = sjob.task(first_failed).paths
            raise StageFailedError(
                f"stage {job.stage} failed (job {sjob.job_id}, state {sjob.state}): {'; '.join(reasons)}\n"
                f"--- stderr tail of task {first_failed} ({paths.stderr}) ---\n{_tail(paths.stderr)}\n"
                f"logs: {paths.folder}"
            )


def _reason(stderr: Path | None, err: Exception) -> str:
    """One line: the task's own error if its stderr has one, else that it died without a result."""
    if stderr is not None and Path(stderr).exists():
        for line in reversed(Path(stderr).read_text(errors="replace").splitlines()):
            text = line.split("]: ", 1)[-1].strip() if line.startswith("[rank") else line.strip()
            if "Error" in text.split(":", 1)[0] or text.startswith(("error:", "pipeline.errors")):
                return text[:300]
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "has not produced any output" in str(err):
        return "died without a result (killed, or exited without a Python error)"
    return first[:300]
