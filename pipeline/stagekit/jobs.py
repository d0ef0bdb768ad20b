"""What the scheduler says about a job: the one place that asks ``squeue``/``sacct`` (or checks a local pid).

Used by the lease (is a launch's job still alive?), by the committer (is the train job it sits beside still
queued or running?) and by ``python -m pipeline.status``. Unknown is never "finished": a scheduler that does not
answer keeps a job counted as alive.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Requeue:
    """A SLURM job that ran and is queued again: why its last run ended, and on which nodes."""

    job_id: str
    restarts: int
    """How many times SLURM has started it again (``Restarts``)."""
    ended: str
    """How its last run ended (``NODE_FAIL``, ``PREEMPTED``, ``TIMEOUT``, ...; ``REQUEUED`` when unknown)."""
    nodes: str
    """The node list of its last run."""
    lost: str
    """Those of them SLURM now has down (the failed nodes), or empty."""
    held_until: str
    """When SLURM lets it start (its begin time), or empty."""
    released: bool = False
    """The launcher lifted that hold (:func:`release_begin_time`)."""

    def line(self, stage: str, latest: str) -> str:
        """One console line: what ended the job's run, that SLURM queued it again, and what it waits for."""
        lost = f": node {self.lost} failed" if self.lost else f" on {self.nodes}" if self.nodes else ""
        wait = f"SLURM holds it until {self.held_until}" if self.held_until else "waiting for SLURM to start it"
        wait += "; its requeue hold was lifted" if self.released else ""
        return (
            f"{stage}: job {self.job_id}'s run ended {self.ended}{lost}; SLURM queued it again (restart "
            f"{self.restarts}) and it resumes from latest = {latest}, the last verified step, on the nodes it gets "
            f"({wait})"
        )


def requeued(job_id: str) -> Requeue | None:
    """The job as requeued by SLURM (pending again after a run), or None when it is not (or SLURM cannot say)."""
    show = _run(["scontrol", "-o", "show", "job", job_id]) or ""
    fields = dict(f.split("=", 1) for f in show.split() if "=" in f)
    restarts = int(fields.get("Restarts", "0") or 0) if fields.get("Restarts", "0").isdigit() else 0
    if fields.get("JobState") not in ("PENDING", "REQUEUED", "REQUEUE_HOLD") or restarts < 1:
        return None
    runs = _run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State,NodeList"]) or ""
    rows = [line.split("|") for line in runs.splitlines() if line.count("|") == 1]
    done = [r for r in rows if r[0] and r[0].split()[0] not in ACTIVE_STATES]
    ended, nodes = (done[-1][0].split()[0], done[-1][1]) if done else ("REQUEUED", "")
    lost = (_run(["sinfo", "-h", "-N", "-t", "down,drain,fail", "-n", nodes, "-o", "%N"]) or "") if nodes else ""
    begin = fields.get("StartTime", "") if fields.get("Reason") == "BeginTime" else ""
    return Requeue(job_id, restarts, ended, nodes, ",".join(sorted(set(lost.split()))), begin)


def release_begin_time(job_id: str) -> bool:
    """Let a requeued job start now instead of at the begin time SLURM set when it requeued it (about two
    minutes later, so that a node that failed is marked down first); True when SLURM took it."""
    return _run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"]) is not None
