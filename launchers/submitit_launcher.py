"""Launch each stage as a submitit job (local executor, or SLURM) and wait for it with a deadline."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import logging
import multiprocessing
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import submitit
from submitit.core.utils import FailedJobError

from launchers.base import JobHandle, Launcher
from launchers.local_forks import PRELOAD_ENV, ForkingLocalExecutor, forked_preload
from launchers.resources import (
    INHERITED_RENDEZVOUS,
    LOCAL_PORT_ENV,
    free_local_port,
    rendezvous_port,
    submitit_parameters,
)
from launchers.task_outcomes import LocalTasks, failure_message, free_space, outcomes, size_text, stale_results
from pipeline.config.launcher import LauncherConfig, LocalLauncherConfig, SlurmLauncherConfig
from pipeline.config.schema import PipelineConfig
from pipeline.driver.supervise import StageJob
from pipeline.driver.task import execute_task
from pipeline.errors import StageFailedError
from pipeline.stagekit import preemption
from pipeline.stagekit.contract import JobRef
from pipeline.stagekit.jobs import ACTIVE_STATES, Requeue, release_begin_time, requeued, slurm_states
from pipeline.stages import get_stage
from pipeline.storage.atomic import clear_file


def task_entry(
    stage: str, cfg: PipelineConfig, run_dir: str, attempt: str, beside: JobRef | None = None
) -> dict[str, object]:
    """Runs in every task of a job: join the job's process group environment, then run the stage.

    Every task of a distributed stage (train) gets MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE from submitit's view of the job (on SLURM: the job's first node, a port derived from the job
    id), so all tasks agree on them, across nodes too. LOCAL_RANK (the task's index on its node) picks the task's
    GPU among all the node's GPUs, so CUDA_VISIBLE_DEVICES is left as the scheduler set it. Other stages get none
    of the variables. On SLURM, train saves and requeues itself on USR2 (time limit or preemption).
    """
    faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT, ...) leaves its name and a traceback in stderr
    env = submitit.JobEnvironment()
    if env.cluster == "local":  # submitit ignores SIGTERM (a SLURM habit); a local cancel must stop the task now
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for key in INHERITED_RENDEZVOUS:
        os.environ.pop(key, None)
    distributed = get_stage(stage).CONTRACT.distributed
    if distributed:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        local = os.environ.get(LOCAL_PORT_ENV) if env.cluster == "local" else None
        os.environ["MASTER_PORT"] = local or str(rendezvous_port(str(env.job_id)))
        if isinstance(cfg.launcher, LocalLauncherConfig):
            os.environ["MASTER_ADDR"] = cfg.launcher.master_addr  # a literal IP: no hostname lookup at rendezvous
    if distributed and isinstance(cfg.launcher, SlurmLauncherConfig):
        preemption.install()  # after submitit's own handlers: USR2 only sets a flag that the ranks agree on
    summary = execute_task(
        stage,
        cfg,
        run_dir,
        attempt,
        rank=env.global_rank,
        world_size=env.num_tasks,
        job_id=str(env.job_id),
        beside=beside,
    )
    if summary.get("requeue"):
        preemption.requeue(env.global_rank, str(env.job_id))  # exits
    if getattr(sys.modules["__main__"], "__file__", "").endswith(_SUBMIT_MAIN):  # a task process, not a test's
        atexit.register(_exit_at_once)  # the first exit handler to run, once submitit has written the result
    return summary


_SUBMIT_MAIN = os.path.join("submitit", "core", "_submit.py")


def _exit_at_once() -> None:
    """A finished task's process ends here, after submitit wrote its result, without the interpreter's teardown
    of torch, gloo and transformers (1-3 s per task, measured: an 8-step tiny run spent 9 s of its 36 in it).
    Only on success: an uncaught exception (submitit could not write the result) leaves ``sys.last_value`` and
    a normal exit with its non-zero status; a child process still running gets the normal exit that joins or
    ends it. Every file the stages write is closed by then (or written with ``os.write``); the logs and the
    standard streams are flushed here."""
    if getattr(sys, "last_value", None) is not None or multiprocessing.active_children():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


LOCAL_JOB_SETUP = ("trap '' INT",)
"""The first line of every local job's setup shell. A local job's processes are the launcher's children, in the
terminal's foreground process group, so a terminal's Ctrl-C (SIGINT to the whole group) would reach them too:
the committer beside train would die with KeyboardInterrupt instead of committing what is staged. Ignored
there (the disposition is inherited by the controller and the tasks; Python keeps an ignored SIGINT ignored),
SIGINT reaches only the launcher, which cancels the jobs itself, as an sbatch job is cancelled: SIGTERM to the
process tree, SIGKILL past ``launcher.cancel_timeout_s``. A second Ctrl-C cancels the committer the same way."""


class RequeuedAtTimeLimit(submitit.helpers.Checkpointable):
    """The committer's entry on SLURM: at its time limit SLURM requeues it, the same job id, instead of ending it.

    Its ``--time`` is one train job plus its last pass (see verify_manifest's contract), while train may requeue
    itself ``launcher.max_num_timeout`` times: requeued, the committer lives on beside it (submitit's countdown
    bounds the requeues; a preemption requeues it anyway), and the jobs queued after it (``afterok``) still
    wait for it, also when no launcher is watching (``launcher.wait=false``). A requeued committer starts again
    as after a kill: it finishes an interrupted commit, then commits each staged step."""

    def __call__(
        self, stage: str, cfg: PipelineConfig, run_dir: str, attempt: str, beside: JobRef | None = None
    ) -> dict[str, object]:
        return task_entry(stage, cfg, run_dir, attempt, beside)


REQUEUE_POLL_S = 5.0
"""How often the launcher asks SLURM (``scontrol show job``) whether a job it watches was requeued."""


class SubmititHandle:
    """One submitted submitit job, as the runner polls it."""

    def __init__(self, launcher: SubmititLauncher, sjob: Any, job: StageJob) -> None:
        self.launcher, self.sjob, self.job = launcher, sjob, job
        self.job_id = str(sjob.job_id)
        self.folder = Path(str(sjob.paths.folder))
        # Several local tasks: watch them, so that one ending while its peers go on is noticed (peer_grace_s).
        local_multi = launcher.cluster == "local" and job.tasks > 1
        self.tasks = LocalTasks(sjob, job.tasks) if local_multi else None
        # A local job starts at once; a queued SLURM job's clock starts when it does (it may wait for train).
        self.deadline: float | None = time.monotonic() + launcher.time_limit_s(job) if not launcher.chains else None
        self._next_look, self._restarts = 0.0, 0
        self._run_since, self._unsettled_since, self._slurm_active = time.time() - 1.0, 0.0, (0.0, True)

    def poll(self) -> bool:
        cfg, job, sjob = self.launcher.cfg, self.job, self.sjob
        if sjob.done() and self._settled():  # (unsettled: the deadline below still holds)
            return True
        if self.deadline is None and str(sjob.state) in ("RUNNING", "COMPLETING"):
            self.deadline = time.monotonic() + self.launcher.time_limit_s(job)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise StageFailedError(
                f"stage {job.stage} (job {sjob.job_id}) ran past its time limit of {job.resources.timeout_min} min "
                f"+ launcher.deadline_grace_s={cfg.deadline_grace_s:g}s and was cancelled; logs: {sjob.paths.folder}"
            )
        if self.tasks is not None:
            self.tasks.poll()
            if self.tasks.overdue(cfg.peer_grace_s):  # submitit's controller would wait for all of them
                ended = outcomes(sjob, job.tasks, self.tasks)
                states = {t: self.tasks.state(t) for t in self.tasks.running()}
                raise StageFailedError(
                    failure_message(
                        job.stage, str(sjob.job_id), ended, self.folder, states=states, grace_s=cfg.peer_grace_s
                    )
                )
        return False

    def _settled(self) -> bool:
        """Whether a SLURM job that submitit calls done is judged now: not while SLURM still holds it and a task has
        no result of this run (its node failed: SLURM requeues it; with several tasks, ``launcher.peer_grace_s``)."""
        if not self.launcher.chains:
            return True
        if not stale_results(self.sjob, self.job.tasks, self._run_since):
            return True
        now = time.monotonic()
        if self._restarts == 0 and self.job.tasks > 1:  # (one task: only SLURM's word, e.g. requeued on NODE_FAIL)
            self._unsettled_since = self._unsettled_since or now
            if now - self._unsettled_since > self.launcher.cfg.peer_grace_s:
                return True
        if now - self._slurm_active[0] >= REQUEUE_POLL_S:
            state = slurm_states([self.job_id]).get(self.job_id)
            self._slurm_active = (now, state in ACTIVE_STATES)  # (unknown: judged, as before)
        return not self._slurm_active[1]

    def outcome(self) -> None:
        self.launcher.check_result(self.sjob, self.job)

    def requeued(self) -> Requeue | None:
        """On SLURM: the job ran and is pending again (SLURM requeued it after a node failure or a preemption).
        SLURM holds a job it requeued for about two minutes; the launcher lifts that hold, since the failed node
        is down by then and the job resumes from ``latest`` on the nodes it gets."""
        now = time.monotonic()
        if not self.launcher.chains or now < self._next_look:
            return None
        self._next_look = now + REQUEUE_POLL_S  # asked of SLURM itself: submitit's sacct view lags up to a minute
        again = requeued(self.job_id)
        if again is None or again.restarts <= self._restarts:
            return None
        self._restarts, self._run_since = again.restarts, time.time()  # results before now are the earlier run's
        # its begin time may lie ahead whatever the reason shown now (Resources while the nodes are busy): lift it
        if release_begin_time(self.job_id):
            again = dataclasses.replace(again, held_until="", released=True)
        return again

    def cancel(self, wait: bool = True) -> None:
        self.launcher.cancel(self.sjob, wait=wait)


class SubmititLauncher(Launcher):
    """Each stage is one submitit job (local executor, or an sbatch job on SLURM).

    Whatever ends a wait early (a deadline, Ctrl-C/SIGTERM raised as ``Interrupted``, any error), the runner
    cancels the job and, on the local executor, its process tree is waited for (``launcher.cancel_timeout_s``)
    and killed if it is still there: nothing of a run outlives its launch. On SLURM every job of the plan is
    submitted at once with its dependencies (``--kill-on-invalid-dep=yes``: a failed upstream job cancels its
    dependents instead of leaving them pending forever).
    """

    def __init__(self, launcher: LauncherConfig, cluster: str) -> None:
        self.cfg = launcher
        self.cluster = cluster
        self.chains = cluster == "slurm"

    def time_limit_s(self, job: StageJob) -> float:
        """How long the launcher waits for a job: its time limit (times the requeues it may take) plus grace."""
        runs = 1 + (self.cfg.max_num_timeout if isinstance(self.cfg, SlurmLauncherConfig) else 0)
        return job.resources.timeout_min * 60 * runs + self.cfg.deadline_grace_s

    def executor(self, job: StageJob, after: Sequence[tuple[str, JobHandle]] = ()) -> Any:
        folder = job.layout.logs / job.stage
        kwargs: dict[str, Any] = {}
        if isinstance(self.cfg, SlurmLauncherConfig):
            kwargs["slurm_max_num_timeout"] = self.cfg.max_num_timeout
        executor = submitit.AutoExecutor(folder=folder / JOB_FOLDER, cluster=self.cluster, **kwargs)
        dependency = ",".join(f"{kind}:{handle.job_id}" for kind, handle in after)
        executor.update_parameters(
            **submitit_parameters(job.contract, job.tasks, job.resources, self.cfg, job.layout.run_id, dependency)
        )
        if self.cluster == "local":
            folder.mkdir(parents=True, exist_ok=True)
            controller_log = shlex.quote(str(folder / CONTROLLER_LOG))  # its own stderr: not the terminal's
            port = [f"export {LOCAL_PORT_ENV}={free_local_port()}"] if job.contract.distributed else []
            preload = forked_preload(job)
            forks = [f"export {PRELOAD_ENV}={shlex.quote(','.join(preload))}"] if preload else []
            executor.update_parameters(local_setup=[*LOCAL_JOB_SETUP, *port, *forks, f"exec 2>>{controller_log}"])
            if preload:  # the same executor, its controller the forking one (launchers.local_forks)
                executor._executor.__class__ = ForkingLocalExecutor
        return executor

    def submit(self, job: StageJob, after: Sequence[tuple[str, JobHandle]] = ()) -> SubmititHandle:
        """Submit the stage's job. A filesystem error while submitit writes the job's pickle (a full disk, a
        read-only run root) is one line naming the stage and the filesystem, not a traceback; so is sbatch
        refusing the job."""
        folder = job.layout.logs / job.stage
        pickles = set(folder.glob("*.pkl")) if folder.is_dir() else set()
        children = {p.pid for p in psutil.Process().children()}
        entry = task_entry
        if self.chains and job.contract.beside is not None:
            entry = RequeuedAtTimeLimit()
        try:
            executor = self.executor(job, after)
            sjob = executor.submit(entry, job.stage, job.cfg, str(job.layout.run_dir), job.attempt, job.beside)
        except OSError as e:
            _undo_submit(folder, pickles, children)
            mount, free = free_space(folder)
            raise StageFailedError(
                f"cannot submit stage {job.stage}: {e.strerror or e} writing "
                f"{e.filename or f'the job file into {folder}'}; free space on {mount} ({size_text(free)} free) "
                "or choose another run.root"
            ) from e
        except FailedJobError as e:  # sbatch refused the job (a bad partition, account or limit)
            _undo_submit(folder, pickles, children)
            why = " ".join(str(e).split())[:500]
            raise StageFailedError(
                f"sbatch refused stage {job.stage}: {why}; check launcher.* and launcher.stages.{job.stage}.*"
            ) from None
        except BaseException:  # an interrupt mid-submit: a controller it may have started is not left behind
            if self.cluster == "local":
                _undo_submit(folder, pickles, children)
            raise
        _drop_empty(folder / JOB_FOLDER)
        return SubmititHandle(self, sjob, job)

    def cancel(self, sjob: Any, wait: bool = True) -> None:
        """Cancel ``sjob`` and wait, bounded, until its processes are gone (killed past the timeout)."""
        if not wait:  # only a scheduler's queue can start a job meanwhile; a local cancel captures its tree below
            if self.cluster != "local":
                sjob.cancel(check=False)
            return
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

    def check_result(self, sjob: Any, job: StageJob) -> None:
        if self.cluster != "local":
            state = str(sjob.state)
            if state.startswith("CANCELLED") and not any(self._logs(sjob)):
                raise StageFailedError(
                    f"stage {job.stage} (job {sjob.job_id}) was cancelled before it started: a job it depends on "
                    "did not succeed, or someone ran scancel"
                )
            for task in range(job.tasks):  # a cluster's result pickle may show up late: let submitit wait for it
                with contextlib.suppress(Exception):
                    sjob.task(task).result()
        ended = outcomes(sjob, job.tasks)
        # The job has ended, its controller too (which makes the literal %j folder again when it starts).
        _drop_empty(job.layout.logs / job.stage / CONTROLLER_LOG, job.layout.logs / job.stage / JOB_FOLDER)
        if any(t.status != "succeeded" for t in ended):
            raise StageFailedError(failure_message(job.stage, str(sjob.job_id), ended, Path(str(sjob.paths.folder))))

    @staticmethod
    def _logs(sjob: Any) -> list[Path]:
        folder = Path(str(sjob.paths.folder))
        return list(folder.glob("*_log.err")) if folder.is_dir() else []


JOB_FOLDER = "%j"
"""submitit's job folder pattern (the scheduler's job id); submitit's executor and local controller also make it
literally, empty."""
CONTROLLER_LOG = "controller.err"
"""A local stage's job controllers' own stderr (not the terminal's); removed again while empty."""


def _drop_empty(*paths: Path) -> None:
    """Remove what is there only by accident when it is empty: the literal ``%j`` folder submitit makes, an
    empty controller log. ``rmdir`` refuses a folder with anything in it; a file is checked empty first."""
    for path in paths:
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            elif path.is_file() and not path.is_symlink() and path.stat().st_size == 0:
                clear_file(path)


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
