"""The run lease: one launching process owns a run at a time, across launches.

``<run_dir>/lease.json`` records the owner: host, pid, launch time, a random launch id, its argv, and the jobs
it submitted (stage, job id, cluster, host). The protocol:

1. A launch takes ``<run_dir>/.lease.lock`` with ``flock(LOCK_EX)`` for the critical section only (bounded wait).
2. It reads the lease without following links. An owner that may be alive, a lease that cannot be parsed, or a
   symlink in its place: refuse, in one line naming the owner (or the file to remove by hand).
3. An owner that is provably gone (its pid is dead on this host, or the scheduler reports every job of an owner
   on another host finished; and no recorded job is alive) loses its lease: it is moved to ``logs/leases/``
   (kept, never deleted) and the break is reported.
4. The new lease is written whole to a temp file, fsynced and hard-linked onto ``lease.json``
   (:func:`~pipeline.storage.atomic.create_exclusive`); ``link`` fails if a lease exists.
5. ``record_job`` rewrites the lease atomically after each submission; ``release`` removes it. Both act only
   while the lease still carries this launch's id.
6. A launch whose scheduler jobs outlive it (SLURM without ``launcher.wait``) ends with ``hand_over``: the lease
   stays, owned by those jobs, and records when the launch left (``handed_over``). Once the scheduler says every
   one has ended the run is free; the next launch takes it over (the old lease is kept, as when breaking one),
   and status says the launch ended normally, not that its lease is stale.

Two mechanisms for two races. ``link`` is atomic on any filesystem a run dir may sit on, NFS included: of two
launches creating a lease exactly one wins, on any hosts. ``flock`` keeps two launches from both breaking one
stale lease (the second would move the first one's fresh lease aside); it may not span hosts on a shared
filesystem, so a breaker also checks that what it moved aside is the lease it judged stale, and puts it back
otherwise. Nothing is broken on a guess: an unknown job state, an unreadable lease, or a pid the kernel still
knows (even if reused) keeps the run refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shlex
import socket
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError, RunBusyError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.records import now_iso, pid_alive
from pipeline.storage.atomic import clear_file, create_exclusive, json_bytes, move_aside, write_json_atomic
from pipeline.storage.settle import parse_settled

JobState = Callable[[str, str], bool | None]
"""(cluster, job_id) -> True if the job is alive, False if it has finished, None if the scheduler cannot say."""

LOCAL_CLUSTERS = ("local", "inprocess")  # a local job id is the pid of the job's controller process
_MAX_LEASE_BYTES = 1 << 20


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _read(path: Path, layout: RunLayout) -> dict[str, Any]:
    """Parse the lease at ``path`` (never through a link); FileNotFoundError if there is none."""
    fix = f"if no launch of run {layout.run_id} is running, remove it by hand (rm {path}) and launch again"

    def read() -> bytes:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunBusyError(f"lease {path} is a symlink, which is never followed; {fix}") from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise RunBusyError(f"lease {path} is not a regular file; {fix}")
            raw = f.read(_MAX_LEASE_BYTES + 1)
        if len(raw) > _MAX_LEASE_BYTES:
            raise RunBusyError(f"lease {path} is over {_MAX_LEASE_BYTES} bytes: its owner is unknown; {fix}")
        return raw

    try:  # read again while it does not parse: another node may be replacing it (pipeline.storage.settle)
        lease = parse_settled(read, json.loads, (ValueError,))
    except ValueError as e:
        raise RunBusyError(_one_line(f"lease {path} is not valid JSON ({e}): its owner is unknown; {fix}")) from None
    fields = {"host": str, "pid": int, "started": str, "launch_id": str, "command": list, "jobs": list}
    bad = [k for k, t in fields.items() if type(lease.get(k)) is not t] if isinstance(lease, dict) else list(fields)
    if not bad and (lease["pid"] <= 0 or not all(isinstance(j, dict) for j in lease["jobs"])):
        bad = ["pid" if lease["pid"] <= 0 else "jobs"]
    if bad:
        raise RunBusyError(f"lease {path} is malformed (bad {', '.join(bad)}): its owner is unknown; {fix}")
    return lease


def read_lease(layout: RunLayout) -> dict[str, Any] | None:
    """The current lease, or None. Raises :class:`RunBusyError` if it is a symlink or cannot be parsed."""
    try:
        return _read(layout.lease, layout)
    except FileNotFoundError:
        return None


def _job_finished(job: dict[str, Any], owner_pid: int, job_state: JobState | None) -> bool:
    """True only if ``job`` has provably finished; unknown counts as alive."""
    cluster, job_id = str(job.get("cluster")), str(job.get("job_id"))
    if cluster in LOCAL_CLUSTERS:
        if job.get("host") != socket.gethostname():
            return False
        # an in-process job without a pid of its own runs inside the owner
        pid = int(job_id) if job_id.isdigit() else owner_pid if cluster == "inprocess" else 0
        return pid > 0 and not pid_alive(pid)
    return job_state is not None and job_state(cluster, job_id) is False


def _gone_reason(lease: dict[str, Any], job_state: JobState | None) -> str | None:
    """Why the owner of ``lease`` is provably gone, or None if it may still be running."""
    here, jobs = socket.gethostname(), lease["jobs"]
    if lease["host"] == here:
        if pid_alive(lease["pid"]):
            return None
        why = f"pid {lease['pid']} is not running on {here}"
    elif jobs:
        why = f"it ran on {lease['host']}"
    else:
        return None  # another host, no jobs: nothing this host can check
    if not all(_job_finished(job, lease["pid"], job_state) for job in jobs):
        return None
    if jobs:
        why += " and its jobs " + ", ".join(f"{j.get('job_id')} ({j.get('cluster')})" for j in jobs) + " finished"
    return why


def _refusal(layout: RunLayout, lease: dict[str, Any]) -> str:
    command = shlex.join(str(a) for a in lease["command"])
    here = lease["host"] == socket.gethostname()
    if here and not pid_alive(lease["pid"]) and lease["jobs"]:
        jobs = [str(j.get("job_id")) for j in lease["jobs"]]
        slurm = any(j.get("cluster") == "slurm" for j in lease["jobs"])
        stop = f"scancel {' '.join(jobs)}" if slurm else f"kill {' '.join(jobs)}"
        return _one_line(
            f"run {layout.run_id} is owned by another launch: pid {lease['pid']} on {lease['host']} since "
            f"{lease['started']} (command: {command}), which has exited, but its jobs {' '.join(jobs)} may still be "
            f"queued or running; wait for them (python -m pipeline.status {layout.run_dir}) or stop them ({stop}), "
            "then launch again"
        )
    return _one_line(
        f"run {layout.run_id} is owned by another launch: pid {lease['pid']} on {lease['host']} since "
        f"{lease['started']} (command: {command}); wait for it, stop it (kill {lease['pid']}), or if it is gone on "
        f"another host remove {layout.lease}"
    )


@contextmanager
def _locked(layout: RunLayout, timeout_s: float) -> Iterator[None]:
    path = layout.lease_lock
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise RunBusyError(f"cannot open lease lock {path}: {e.strerror}; if it is a symlink, remove it") from None
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RunBusyError(
                        f"could not lock {path} within {timeout_s:g}s: another launch of run {layout.run_id} is "
                        f"taking or releasing its lease; retry, or find the holder with: fuser {path}"
                    ) from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the flock


def _break(layout: RunLayout, stale: dict[str, Any], why: str, say: Callable[[str], None]) -> None:
    layout.logs.mkdir(mode=0o700, exist_ok=True)  # normally made by the launcher; it holds pickles
    safe = re.sub(r"[^0-9A-Za-z_-]", "", f"{stale['started']}.{stale['launch_id']}".replace(".", "_"))[:64]
    try:
        aside = move_aside(layout.lease, layout.broken_leases, f"lease.{safe}.json")
    except FileNotFoundError:  # a launch on another host broke it first; creating the new lease decides
        return
    moved = _read(aside, layout)
    if moved["launch_id"] != stale["launch_id"]:  # a launch on another host broke it and took the run first
        create_exclusive(layout.lease, json_bytes(moved))
        raise RunBusyError(_refusal(layout, moved))
    owner = f"{stale['host']}:{stale['pid']} (started {stale['started']})"
    if isinstance(stale.get("handed_over"), str):  # a launch that ended normally, leaving the run to its jobs
        say(_one_line(f"took the run over from launch {owner}, which left it to its jobs: {why}; kept as {aside}"))
    else:
        say(_one_line(f"broke stale lease of {owner}: {why}; kept as {aside}"))


class RunLease:
    """This launch's hold on a run. Take it with :meth:`acquire`; give it back with :meth:`release` or ``with``."""

    def __init__(self, layout: RunLayout, record: dict[str, Any], lock_timeout_s: float) -> None:
        self.layout, self.record, self.launch_id = layout, record, str(record["launch_id"])
        self._lock_timeout_s = lock_timeout_s
        self._released = False

    @classmethod
    def acquire(
        cls,
        layout: RunLayout,
        *,
        command: list[str],
        say: Callable[[str], None] = print,
        job_state: JobState | None = None,
        lock_timeout_s: float = 10.0,
    ) -> RunLease:
        """Own ``layout``'s run (its dir must exist), breaking a provably stale lease; else :class:`RunBusyError`."""
        if not layout.run_dir.is_dir():
            raise PipelineError(f"cannot take the lease of run {layout.run_id}: {layout.run_dir} is not a directory")
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": now_iso(),
            "launch_id": secrets.token_hex(8),
            "command": [str(a) for a in command],
            "jobs": [],
        }
        with _locked(layout, lock_timeout_s):
            current = read_lease(layout)
            if current is not None:
                why = _gone_reason(current, job_state)
                if why is None:
                    raise RunBusyError(_refusal(layout, current))
                _break(layout, current, why, say)
            if not create_exclusive(layout.lease, json_bytes(record)):
                current = read_lease(layout)  # a launch on another host won (flock may not span hosts)
                raise RunBusyError(_refusal(layout, current) if current else f"{layout.lease} changed; launch again")
        return cls(layout, record, lock_timeout_s)

    def _lost(self) -> str | None:
        """None while the lease is still this launch's, else what became of it."""
        try:
            current = read_lease(self.layout)
        except RunBusyError as e:
            return str(e)
        if current is None:
            return "it was removed"
        if current["launch_id"] != self.launch_id:
            return f"pid {current['pid']} on {current['host']} holds it since {current['started']}"
        return None

    def record_job(self, stage: str, job_id: str, cluster: str) -> None:
        """Add a submitted job to the lease (so a later launch can tell whether it still runs)."""
        job = {"stage": stage, "job_id": str(job_id), "cluster": cluster, "host": socket.gethostname()}
        with _locked(self.layout, self._lock_timeout_s):
            lost = self._lost()
            if lost is not None:
                raise RunBusyError(
                    f"run {self.layout.run_id}: cannot record job {job_id} of stage {stage}: this launch (pid "
                    f"{os.getpid()}) no longer holds {self.layout.lease} ({lost}); stop this launch and check "
                    "who runs the run before launching again"
                )
            self.record["jobs"].append(job)
            write_json_atomic(self.layout.lease, self.record)

    def release(self) -> None:
        """Remove the lease if it is still this launch's; a second call does nothing."""
        if self._released:
            return
        with _locked(self.layout, self._lock_timeout_s):
            if self._lost() is None:  # someone else's lease (or none) is not ours to remove
                clear_file(self.layout.lease)
        self._released = True

    def hand_over(self) -> None:
        """Leave the lease in place for this launch's scheduler jobs, which outlive it: a later launch takes it
        over only when the scheduler says every recorded job has finished. The lease records when this launch
        left (``handed_over``): a lease whose launch ended normally is not a stale one. Best effort: a lease that
        cannot be rewritten now stays as it was."""
        if self._released:
            return
        self._released = True
        try:
            with _locked(self.layout, self._lock_timeout_s):
                if self._lost() is None:
                    self.record["handed_over"] = now_iso()
                    write_json_atomic(self.layout.lease, self.record)
        except (PipelineError, OSError):
            pass

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
