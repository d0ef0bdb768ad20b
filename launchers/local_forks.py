"""A local job's controller that imports what its tasks need once, then forks them (``launcher.fork_tasks``).

Submitit's local controller starts each task of a job as a new interpreter (``python -m submitit.core._submit``),
so every rank of a local train job imports torch, DCP and the model's ``transformers`` code itself: about 6 CPU-s
per rank on a 2-core machine, most of a tiny run's cost. This controller is submitit's own
(:class:`submitit.local.local.Controller`: the same task log files, timeout, signal forwarding and requeue loop),
but it imports the modules the launcher names in :data:`PRELOAD_ENV` first and then forks each task from itself.
Each forked task is then what submitit's would be: its stdout and stderr are its own log files, its environment
names its task (``SUBMITIT_LOCAL_LOCALID``, ``SUBMITIT_LOCAL_GLOBALID``, ``SUBMITIT_LOCAL_JOB_ID``), SIGTERM has
its default action, and it runs submitit's ``process_job`` on the job folder. A forked task's command line and
``/proc`` environment are the controller's, so the controller writes ``<job id>_tasks.json`` (task -> pid) into
the job folder once every task is forked: :class:`launchers.task_outcomes.LocalTasks` reads it.

Used only for CPU jobs of several tasks (gloo): nothing initialises CUDA before a fork there, and a one-task job
gains nothing. Forking after ``import torch`` is what a ``DataLoader``'s workers do on Linux.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from submitit.core import utils
from submitit.local.local import Controller, LocalExecutor, LocalJob

from pipeline.storage.atomic import write_json_atomic

if TYPE_CHECKING:
    from pipeline.driver.supervise import StageJob

PRELOAD_ENV = "PIPELINE_PRELOAD"
"""Comma-separated modules the controller imports before it forks the tasks (set by the launcher)."""
TASKS_FILE = "{job_id}_tasks.json"
"""In the job folder: ``{"0": pid, "1": pid, ...}``, written once every task is forked."""


def forked_preload(job: StageJob) -> list[str]:
    """What the controller of ``job`` imports before it forks the tasks; empty: no forking (one task, a GPU job,
    ``launcher.fork_tasks=false``, a stage whose tasks are not ranks)."""
    cfg = job.cfg
    if job.tasks < 2 or not job.contract.distributed or job.resources.gpus_per_task or cfg.strategy.backend != "gloo":
        return []
    if not getattr(cfg.launcher, "fork_tasks", False):
        return []
    modules = ["launchers.submitit_launcher", "pipeline.stagekit.train_job"]
    model_type = "llama" if cfg.model.route == "llama" else str(cfg.model.config.get("model_type", ""))
    if model_type.isidentifier():  # the model's transformers code, which train builds it with (best effort)
        modules.append(f"transformers.models.{model_type}.modeling_{model_type}")
    if cfg.strategy.name == "deepspeed":
        modules.append("deepspeed")
    return modules


def forked_tasks(job_folder: Path, job_id: str) -> dict[int, int]:
    """Task -> pid of a forking controller's job (empty until every task is forked, or for any other job)."""
    try:
        return {
            int(k): int(v) for k, v in json.loads((job_folder / TASKS_FILE.format(job_id=job_id)).read_text()).items()
        }
    except (OSError, ValueError, AttributeError):
        return {}


class ForkingLocalExecutor(LocalExecutor):
    """Submitit's local executor whose job controller is :class:`ForkingController` (this module)."""

    def _submit_command(self, command: str) -> LocalJob[Any]:
        ntasks = self.parameters.get("tasks_per_node", 1)
        env = dict(os.environ)
        env.update(
            SUBMITIT_LOCAL_NTASKS=str(ntasks),
            SUBMITIT_LOCAL_COMMAND=command,
            SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters.get("timeout_min", 2.0))),
            SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters.get("signal_delay_s", 30))),
            SUBMITIT_LOCAL_NODEID="0",
            SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_STDERR_TO_STDOUT="1" if self.parameters.get("stderr_to_stdout", False) else "",
            SUBMITIT_EXECUTOR="local",
            CUDA_VISIBLE_DEVICES="",  # a CPU job: forking is never used with GPUs (forked_preload)
            SUBMITIT_LOCAL_WITH_SHELL="1",
        )
        cmd = shlex.join([sys.executable, "-m", "launchers.local_forks", str(self.folder)])
        process = subprocess.Popen(" && ".join([*self.parameters.get("setup", ()), cmd]), shell=True, env=env)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))


class ForkedTask:
    """A forked task as submitit's controller uses a ``Popen``: ``poll`` and ``send_signal``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already (cannot happen here, but never loop on it)
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # never a signal to a reaped pid (another process may have it by now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


class ForkingController(Controller):
    """Submitit's local controller, its tasks forked from this process (module doc)."""

    def start_tasks(self) -> None:
        self.folder.mkdir(exist_ok=True)
        paths = [utils.JobPaths(self.folder, self.pid, k) for k in range(self.ntasks)]
        self.stdouts = [p.stdout.open("a") for p in paths]
        self.stderrs = self.stdouts if self.stderr_to_stdout else [p.stderr.open("a") for p in paths]
        pids: dict[str, int] = {}
        for k in range(self.ntasks):
            for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice by a child
                stream.flush()
            pid = os.fork()
            if pid == 0:
                _run_task(self.folder, self.pid, k, self.stdouts[k], self.stderrs[k])  # never returns
            self.tasks.append(ForkedTask(pid))  # type: ignore[arg-type]
            pids[str(k)] = pid
        where = utils.JobPaths(self.folder, self.pid).folder / TASKS_FILE.format(job_id=self.pid)
        write_json_atomic(where, pids)  # whole or absent for the launcher that reads it


def _run_task(folder: Path, job_id: str, task: int, out: Any, err: Any) -> None:
    """In the forked child: become task ``task`` of the job and run it; the process ends here."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the controller's forwarding handler is not the task's
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.environ.update(
            SUBMITIT_LOCAL_LOCALID=str(task), SUBMITIT_LOCAL_GLOBALID=str(task), SUBMITIT_LOCAL_JOB_ID=job_id
        )
        from submitit.core.submission import process_job  # noqa: PLC0415

        process_job(str(folder))
        code = 0
    except SystemExit as e:  # a requeue (preemption) exits with its own code
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - submitit wrote the error as the task's result; say it, exit non-zero
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if code == 0 and multiprocessing.active_children():
            sys.exit(0)  # a child process of the task's still runs: the normal exit joins or ends it
        os._exit(code)  # without the controller's teardown, as a finished task does (_exit_at_once)


def _preload() -> None:
    """Import what the tasks will import; a module that fails here fails in the task, where it is reported."""
    for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        with contextlib.suppress(Exception):
            importlib.import_module(name)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m launchers.local_forks <submitit folder>")
    _preload()
    ForkingController(Path(sys.argv[1])).run()
