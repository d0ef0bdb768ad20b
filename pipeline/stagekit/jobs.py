"""What the scheduler says about a job: the one place that asks ``squeue``/``sacct`` (or checks a local pid).

Used by the lease (is a launch's job still alive?), by the committer (is the train job it sits beside still
queued or running?) and by ``python -m pipeline.status``. Unknown is never "finished": a scheduler that does not
answer keeps a job counted as alive.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable

from pipeline.stagekit.records import pid_alive

LOCAL_CLUSTERS = ("local", "inprocess")
"""A local job id is the pid of the job's controller process."""

ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "RUNNING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "CONFIGURING",
        "COMPLETING",
        "SUSPENDED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
    }
)
"""SLURM states of a job that has not finished (a requeued job is PENDING again)."""

_TIMEOUT_S = 20.0


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def slurm_states(job_ids: Iterable[str]) -> dict[str, str]:
    """SLURM state of each job (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ``CANCELLED``, ``TIMEOUT``,
    ...). ``squeue`` answers for queued and running jobs, ``sacct`` (accounting) for finished ones. A job neither
    knows is missing from the result (unknown)."""
    ids = sorted({str(j) for j in job_ids if str(j).isdigit()})
    if not ids:
        return {}
    states: dict[str, str] = {}
    queued = _run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"])
    for line in (queued or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ids:
            states[parts[0]] = parts[1]
    rest = [j for j in ids if j not in states]
    if rest:
        done = _run(["sacct", "-n", "-P", "-X", "-j", ",".join(rest), "-o", "JobIDRaw,State"])
        for line in (done or "").splitlines():  # a requeued job has several rows: the last is its newest run
            parts = line.split("|")
            if len(parts) == 2 and parts[0] in rest and parts[1]:
                states[parts[0]] = parts[1].split()[0]  # "CANCELLED by 0" -> "CANCELLED"
    return states


def job_alive(cluster: str, job_id: str) -> bool | None:
    """True: queued or running; False: finished (any way); None: the scheduler cannot say."""
    if cluster in LOCAL_CLUSTERS:
        return pid_alive(int(job_id)) if job_id.isdigit() and int(job_id) > 0 else None
    state = slurm_states([job_id]).get(job_id)
    if state is None:
        return None
    return state in ACTIVE_STATES
