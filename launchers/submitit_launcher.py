"""Launch each stage as a submitit job (local executor, or SLURM) and wait for it with a deadline."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shlex
import time
from pathlib import Path
from typing import Any

import psutil
import submitit

from launchers.base import Launcher
from launchers.resources import submitit_parameters
from launchers.task_outcomes import LocalTasks, failure_message, free_space, outcomes, size_text
from pipeline.config.schema import LauncherConfig, LocalLauncherConfig, PipelineConfig
from pipeline.errors import StageFailedError
from pipeline.orchestration.runner import JobWatch, StageJob
from pipeline.orchestration.task import execute_task
from pipeline.stages import get_stage
from pipeline.storage.atomic import clear_file

# What a surrounding launcher (torchrun, a SLURM allocation, a user's shell) may have left in the environment. Any
# of the first six makes TorchDistributedEnvironment.export() refuse ("... is already set"); an inherited
# MASTER_PORT would also become the job's port; TORCHELASTIC_USE_AGENT_STORE=True would make rank 0 a client of a
# store nobody hosts. A job's rendezvous is its own, so every task drops them all.
_INHERITED_RENDEZVOUS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def task_entry(stage: str, cfg: PipelineConfig, run_dir: str, attempt: str) -> dict[str, object]:
    """Runs in every task of a job: join the job's process group environment, then run the stage.

    Every task of a distributed stage (train) gets MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE, a single-task job too: the stage always joins a process group. The port is derived from the
    job id, so all tasks agree on it. LOCAL_RANK (the task's index on its node) picks the task's GPU among all the
    node's GPUs, so CUDA_VISIBLE_DEVICES is left as the scheduler set it. Other stages get none of the variables.
    """
    faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT, ...) leaves its name and a traceback in stderr
    env = submitit.JobEnvironment()
    for key in _INHERITED_RENDEZVOUS:
        os.environ.pop(key, None)
    if get_stage(stage).CONTRACT.distributed:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        if isinstance(cfg.launcher, LocalLauncherConfig):
            os.environ["MASTER_ADDR"] = cfg.launcher.master_addr  # a literal IP: no hostname lookup at rendezvous
    return execute_task(
        stage, cfg, run_dir, attempt, rank=env.global_rank, world_size=env.num_tasks, job_id=str(env.job_id)
    )


class SubmititLauncher(Launcher):
    """Each stage is one submitit job; the launching process waits for it with a deadline.

    Whatever ends the wait early (a deadline, Ctrl-C/SIGTERM raised as ``Interrupted``, any error), the job is
    cancelled and, on the local executor, its process tree is waited for (``launcher.cancel_timeout_s``) and
    killed if it is still there: nothing of a run outlives its launch.
    """

    def __init__(self, launcher: LauncherConfig, cluster: str) -> None:
        self.cfg = launcher
        self.cluster = cluster

    def run_stage(self, job: StageJob, watch: JobWatch) -> None:
        sjob = self._submit(job)
        # Several local tasks: watch them, so that one ending while its peers go on is noticed (peer_grace_s).
        tasks = LocalTasks(sjob, job.tasks) if self.cluster == "local" and job.tasks > 1 else None
        try:
            watch.started(str(sjob.job_id), self.cluster, Path(str(sjob.paths.folder)))
            self._wait(sjob, job, watch, tasks)
        except BaseException:
            self._cancel(sjob)
            raise
        self._check_result(sjob, job)

    def _submit(self, job: StageJob) -> Any:
        """Submit the stage's job. A filesystem error while submitit writes the job's pickle (a full disk, a
        read-only run root) is one line naming the stage and the filesystem, not a traceback."""
        folder = job.layout.logs / job.stage
        pickles = set(folder.glob("*.pkl")) if folder.is_dir() else set()
        children = {p.pid for p in psutil.Process().children()}
        try:
            executor = submitit.AutoExecutor(folder=folder / "%j", cluster=self.cluster)
            executor.update_parameters(
                **submitit_parameters(job.contract, job.tasks, job.resources, self.cfg, job.layout.run_id)
            )
            if self.cluster == "local":
                # The job controller shares our terminal; its own stderr (a KeyboardInterrupt traceback when a
                # terminal's Ctrl-C reaches the whole process group) goes to the stage's log folder instead.
                folder.mkdir(parents=True, exist_ok=True)
                controller_log = shlex.quote(str(folder / "controller.err"))
                executor.update_parameters(local_setup=[f"exec 2>>{controller_log}"])
            return executor.submit(task_entry, job.stage, job.cfg, str(job.layout.run_dir), job.attempt)
        except OSError as e:
            _undo_submit(folder, pickles, children)
            mount, free = free_space(folder)
            raise StageFailedError(
                f"cannot submit stage {job.stage}: {e.strerror or e} writing "
                f"{e.filename or f'the job file into {folder}'}; free space on {mount} ({size_text(free)} free) "
                "or choose another run.root"
            ) from e

    def _wait(self, sjob: Any, job: StageJob, watch: JobWatch, tasks: LocalTasks | None) -> None:
        limit_s = job.resources.timeout_min * 60 + self.cfg.deadline_grace_s
        deadline = time.monotonic() + limit_s
        while not sjob.done():
            if time.monotonic() > deadline:
                raise StageFailedError(
                    f"stage {job.stage} (job {sjob.job_id}) ran past its time limit of {job.resources.timeout_min} min "
                    f"+ launcher.deadline_grace_s={self.cfg.deadline_grace_s:g}s and was cancelled; "
                    f"logs: {sjob.paths.folder}"
                )
            if tasks is not None:
                tasks.poll()
                if tasks.overdue(self.cfg.peer_grace_s):  # submitit's controller would wait for all of them
                    ended = outcomes(sjob, job.tasks, tasks)
                    states = {t: tasks.state(t) for t in tasks.running()}
                    raise StageFailedError(
                        failure_message(
                            job.stage,
                            str(sjob.job_id),
                            ended,
                            Path(str(sjob.paths.folder)),
                            states=states,
                            grace_s=self.cfg.peer_grace_s,
                        )
                    )
            watch.poll()
            time.sleep(self.cfg.poll_interval_s)

    def _cancel(self, sjob: Any) -> None:
        """Cancel ``sjob`` and wait, bounded, until its processes are gone (killed past the timeout)."""
        procs = _process_tree(sjob) if self.cluster == "local" else []
        try:
            if procs:  # SIGTERM to the whole tree: ranks stop, the controller sees them gone and exits quietly
                for p in procs:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.terminate()
                # A stopped process (SIGSTOP) cannot act on SIGTERM until continued, and nobody will continue it.
                _kill([p for p in procs if _status(p) == psutil.STATUS_STOPPED])
                _gone, alive = psutil.wait_procs(procs, timeout=self.cfg.cancel_timeout_s)
            else:
                sjob.cancel(check=False)
                deadline = time.monotonic() + self.cfg.cancel_timeout_s
                while not sjob.done() and time.monotonic() < deadline:
                    time.sleep(self.cfg.poll_interval_s)
                alive = []
        except BaseException:  # a second Ctrl-C while waiting: stop waiting, kill now
            alive = [p for p in procs if p.is_running()]
            _kill(alive)
            raise
        _kill(alive)

    def _check_result(self, sjob: Any, job: StageJob) -> None:
        if self.cluster != "local":  # a cluster's result pickle may show up late: let submitit wait for it
            for task in range(job.tasks):
                with contextlib.suppress(Exception):
                    sjob.task(task).result()
        ended = outcomes(sjob, job.tasks)
        if any(t.status != "succeeded" for t in ended):
            raise StageFailedError(failure_message(job.stage, str(sjob.job_id), ended, Path(str(sjob.paths.folder))))


def _undo_submit(folder: Path, pickles: set[Path], children: set[int]) -> None:
    """After a failed submit: remove the partial job pickle, and end a controller that may have started."""
    for path in set(folder.glob("*.pkl")) - pickles if folder.is_dir() else ():
        with contextlib.suppress(OSError):
            clear_file(path)
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if child.pid not in children and str(folder) in " ".join(child.cmdline()):
                _kill([child, *child.children(recursive=True)])


def _process_tree(sjob: Any) -> list[psutil.Process]:
    """The local job's process (its pid is the job id: the setup shell) and every process under it."""
    try:
        root = psutil.Process(int(sjob.job_id))
        return [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, ValueError):
        return []


def _status(proc: psutil.Process) -> str | None:
    try:
        return str(proc.status())
    except psutil.NoSuchProcess:
        return None


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=5)
