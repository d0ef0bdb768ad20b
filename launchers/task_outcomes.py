"""How the tasks of one stage job ended, and the one line that names the root cause of a failure.

A failed job's tasks rarely fail for one reason: the rank that raised first takes its peers down with it
(gloo's "Connection closed by peer", a collective's timeout). Each task's stderr holds the failure line of
:func:`pipeline.driver.task.failure_line` (which rank, when, what), and its result pickle, if any;
a task with neither died without a Python error (a signal). The root cause is the task that ended first,
preferring errors that are not collective side effects; its log path ends the line and holds the traceback.

While a local job runs, :class:`LocalTasks` watches its task processes so that the launcher can notice one
task ending while its peers go on (stopped, or blocked in a collective that will never complete).
"""

from __future__ import annotations

import errno
import math
import os
import pickle
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from launchers.local_forks import forked_tasks
from pipeline.driver.task import parse_failure_line

# Errors a task gets because a peer failed, not because of anything of its own: they never make the root cause
# while another task has a reason of its own.
_SIDE_EFFECT = re.compile(
    r"Connection closed by peer|Connection reset|Broken pipe|DistBackendError|DistNetworkError|DistStoreError|"
    r"gloo|NCCL|timed out|timeout|KeyboardInterrupt|SystemExit",
    re.IGNORECASE,
)
# The last line of a Python traceback (torch prefixes a rank's lines with "[rankK]: "), or faulthandler's line.
_EXCEPTION = re.compile(
    r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Fault|Interrupt|Exit)(?::\s.*)?"
    r"|Fatal Python error: .*)$"
)
DIED = "without a result or a Python error (killed by a signal, e.g. SIGKILL or the OOM killer, or a hard exit)"
# Storage errors that libraries wrap in their own (torch.save's "unexpected pos", DCP's CheckpointException):
# when a task's log shows one that its error line does not, the line says so.
_STORAGE_ERRORS = tuple(os.strerror(e) for e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO))
_FULL_BYTES = 1 << 20  # less free space than this on the log folder's filesystem: say the disk is full
_STARTUP_S = 10.0  # the controller starts its tasks in one loop: one not seen this long after the first has ended


@dataclass(frozen=True)
class TaskOutcome:
    """One task of a job: ``succeeded``, ``failed`` (a Python error), ``died`` (neither result nor error) or
    ``running``; ``at`` is the unix time it ended (inf while running), ``error`` one line."""

    task: int
    status: str
    at: float
    error: str
    log: Path

    @property
    def side_effect(self) -> bool:
        return self.status == "failed" and bool(_SIDE_EFFECT.search(self.error))


def outcomes(sjob: Any, ntasks: int, watched: LocalTasks | None = None) -> list[TaskOutcome]:
    """How each task of ``sjob`` ended; tasks the watcher has not seen end count as ``running``."""
    result = []
    for task in range(ntasks):
        paths = sjob.task(task).paths
        log = Path(paths.stderr)
        failure, last_error, storage = _read_log(log)
        kind, value = _read_result(Path(paths.result_pickle))
        if kind == "success":
            result.append(TaskOutcome(task, "succeeded", _mtime(Path(paths.result_pickle)), "", log))
        elif failure is not None:
            result.append(TaskOutcome(task, "failed", failure[1], _with_storage(failure[2], storage), log))
        elif kind == "error":
            error = _last_exception(str(value).splitlines()) or "failed (no error text)"
            error = _with_storage(error, storage)
            result.append(TaskOutcome(task, "failed", _mtime(Path(paths.result_pickle)), error, log))
        elif watched is not None and task in watched.running():
            result.append(TaskOutcome(task, "running", math.inf, "", log))
        else:
            seen = watched.ended.get(task) if watched is not None else None
            at = seen if seen is not None else _mtime(log)
            error = _with_storage(last_error, storage) if last_error else ""
            result.append(TaskOutcome(task, "failed" if last_error else "died", at, error, log))
    return result


def stale_results(sjob: Any, ntasks: int, since: float) -> list[int]:
    """Tasks of ``sjob`` with no result written since ``since`` (wall-clock seconds: the job's submission, or the
    launcher's sight of its last requeue): killed with their node, or holding a result of a run before a requeue."""
    stale = []
    for task in range(ntasks):
        try:
            written = Path(sjob.task(task).paths.result_pickle).stat().st_mtime
        except OSError:
            written = -math.inf
        if written < since:
            stale.append(task)
    return stale


def _with_storage(error: str, storage: str | None) -> str:
    return f"{error} ({storage} in its log)" if storage and storage not in error else error


def failure_message(
    stage: str,
    job_id: str,
    tasks: list[TaskOutcome],
    folder: Path,
    *,
    states: dict[int, str] | None = None,
    grace_s: float = 0.0,
) -> str:
    """One line: the task that failed first with its own error, what became of the others, its log.

    Tasks still ``running`` are the ones the launcher cancels ``grace_s`` after the first end; ``states`` says
    how each looks from outside (``stopped``, ``blocked in I/O``, ``running``)."""
    bad = [t for t in tasks if t.status in ("failed", "died")]
    running = [t for t in tasks if t.status == "running"]
    stuck = ", ".join(f"{t.task} ({(states or {}).get(t.task, 'running')})" for t in running)
    stuck = f"{'rank' if len(running) == 1 else 'ranks'} {stuck}"
    grace = f"launcher.peer_grace_s={grace_s:g}s"
    if not bad:  # every task that ended succeeded, but not all of them ended
        done = [t for t in tasks if t.status == "succeeded"]
        return (
            f"stage {stage} failed (job {job_id}): {_ranks(done)} finished but {stuck} did not end within {grace}: "
            f"cancelled; log: {running[0].log}"
        )
    root = min(bad, key=lambda t: (t.side_effect, t.at, t.task))
    first = " first" if len(bad) > 1 or running else ""
    blames_stuck = bool(running) and root.side_effect  # the peers that did not end are the likelier cause
    if len(tasks) == 1:
        head = _clip(root.error) if root.status == "failed" else f"its task died {DIED}"
    elif blames_stuck:
        head = f"{stuck} stopped responding: rank {root.task} failed waiting for it: {_clip(root.error)}"
    elif root.status == "failed":
        head = f"rank {root.task} failed{first}: {_clip(root.error)}"
    else:
        head = f"rank {root.task} died{first} {DIED}"
    notes = [head]
    if others := [t for t in bad if t is not root]:
        notes.append(f"then {_ranks(others)} failed too")
    if running:
        notes.append(f"cancelled after {grace}" if blames_stuck else f"{stuck} cancelled after {grace}")
    mount, free = free_space(folder)
    if free < _FULL_BYTES:
        notes.append(
            f"{os.strerror(errno.ENOSPC)} on {mount} ({size_text(free)} free): free space on it or choose another "
            "run.root"
        )
    return f"stage {stage} failed (job {job_id}): {'; '.join(notes)}; log: {root.log}"


def free_space(path: Path) -> tuple[Path, int]:
    """The mount point holding ``path`` (or its nearest existing parent) and its free bytes."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    mount = p
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        return mount, shutil.disk_usage(p).free
    except OSError:
        return mount, _FULL_BYTES


def size_text(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _ranks(tasks: list[TaskOutcome]) -> str:
    return ("rank " if len(tasks) == 1 else "ranks ") + ", ".join(str(t.task) for t in tasks)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _last_exception(lines: list[str]) -> str | None:
    for line in reversed(lines):
        m = _EXCEPTION.match(line.rstrip())
        if m:
            return m.group(1).strip()
    return None


def _read_log(path: Path) -> tuple[tuple[int, float, str] | None, str | None, str | None]:
    """A task's stderr: its failure line (the first), the last exception line of a traceback, and the first
    storage error (``No space left on device``, ...) anywhere in it."""
    failure: tuple[int, float, str] | None = None
    last = storage = None
    try:
        with path.open(errors="replace") as f:
            for line in f:
                failure = failure or parse_failure_line(line)
                m = _EXCEPTION.match(line.rstrip())
                last = m.group(1).strip() if m else last
                storage = storage or next((text for text in _STORAGE_ERRORS if text in line), None)
    except OSError:
        pass
    return failure, last, storage


def _read_result(path: Path) -> tuple[str | None, Any]:
    """submitit's result pickle: ``("success", value)`` or ``("error", traceback text)``; (None, None) if absent.

    The pickle is the job's own, in the run's 0700 log folder, as trusted as submitit itself trusts it."""
    try:
        outcome = pickle.loads(path.read_bytes())  # noqa: S301 - our own job's result, see above
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, IndexError):
        return None, None
    if isinstance(outcome, tuple) and len(outcome) == 2 and outcome[0] in ("success", "error"):
        return outcome[0], outcome[1]
    return None, None


class _FailureScan:
    """Reads a task's stderr as it grows, until its failure line appears."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""
        self.found: tuple[int, float, str] | None = None

    def poll(self) -> tuple[int, float, str] | None:
        if self.found is not None:
            return self.found
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read(1 << 20)
        except OSError:
            return None
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        self.partial = self.partial[-(1 << 16) :]
        for line in lines:
            self.found = self.found or parse_failure_line(line.decode(errors="replace"))
        return self.found


class LocalTasks:
    """The task processes of one local job, watched while the launcher waits: which ended, when, which run on.

    The job id is the pid of the setup shell; below it runs submitit's controller (``submitit.local._local``),
    whose children are the tasks, one process each, told apart by ``SUBMITIT_LOCAL_GLOBALID`` in their
    environment. A task has ended when its failure line is in its stderr, its result pickle exists, or its
    process is gone.
    """

    def __init__(self, sjob: Any, ntasks: int) -> None:
        self.sjob, self.ntasks = sjob, ntasks
        self.procs: dict[int, psutil.Process] = {}
        self.ended: dict[int, float] = {}  # task -> unix time the launcher saw it end
        self.first_end: float | None = None  # monotonic time of the first end
        self._first_seen: float | None = None  # monotonic time the first task process was seen
        self._scans = [_FailureScan(Path(sjob.task(t).paths.stderr)) for t in range(ntasks)]

    def poll(self) -> None:
        if len(self.procs) < self.ntasks:
            self._discover()
        for task in range(self.ntasks):
            if task not in self.ended and self._has_ended(task):
                self.ended[task] = time.time()
                self.first_end = self.first_end if self.first_end is not None else time.monotonic()

    def running(self) -> list[int]:
        return [t for t in range(self.ntasks) if t not in self.ended]

    def overdue(self, grace_s: float) -> bool:
        """A task ended more than ``grace_s`` ago and another one is still running."""
        return self.first_end is not None and bool(self.running()) and time.monotonic() - self.first_end > grace_s

    def state(self, task: int) -> str:
        """How a running task looks from outside: ``stopped`` (SIGSTOP), ``blocked in I/O``, ``running``."""
        proc = self.procs.get(task)
        if proc is None:
            return "not started"
        try:
            status = proc.status()
        except psutil.NoSuchProcess:
            return "gone"
        return {psutil.STATUS_STOPPED: "stopped", psutil.STATUS_DISK_SLEEP: "blocked in I/O"}.get(status, "running")

    def _has_ended(self, task: int) -> bool:
        proc = self.procs.get(task)
        if proc is not None and not _alive(proc):
            return True
        if proc is None and self._first_seen is not None and time.monotonic() - self._first_seen > _STARTUP_S:
            return True  # it ended before the watcher ever saw it
        if Path(self.sjob.task(task).paths.result_pickle).exists():
            return True
        return self._scans[task].poll() is not None

    def _discover(self) -> None:
        try:
            root = psutil.Process(int(self.sjob.job_id))
            tree = [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, ValueError):
            return
        for proc in tree:
            try:
                cmdline = proc.cmdline()
                if any("launchers.local_forks" in part for part in cmdline):
                    self._discover_forked(proc)
                    continue
                if not any("submitit.local._local" in part for part in cmdline):
                    continue
                children = proc.children()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for child in children:
                try:  # before its exec, a fresh child still has the controller's environment: look again later
                    env = child.environ()
                    if "submitit.core._submit" not in " ".join(child.cmdline()):
                        continue
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if env.get("SUBMITIT_LOCAL_JOB_ID") == str(self.sjob.job_id) and "SUBMITIT_LOCAL_GLOBALID" in env:
                    self.procs.setdefault(int(env["SUBMITIT_LOCAL_GLOBALID"]), child)
                    self._first_seen = self._first_seen if self._first_seen is not None else time.monotonic()

    def _discover_forked(self, controller: psutil.Process) -> None:
        """A forking controller's tasks (:mod:`launchers.local_forks`): their command line and ``/proc``
        environment are the controller's, so it names them in ``<job id>_tasks.json`` once all are forked."""
        children = {c.pid: c for c in controller.children()}
        for task, pid in forked_tasks(Path(self.sjob.paths.folder), str(self.sjob.job_id)).items():
            if pid in children:
                self.procs.setdefault(task, children[pid])
                self._first_seen = self._first_seen if self._first_seen is not None else time.monotonic()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
