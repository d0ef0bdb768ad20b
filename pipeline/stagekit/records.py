"""Stage records: ``stages/<stage>.json`` says what ran, when, where, and how it ended.

Owner: task 0 of the stage's job (the only task that writes it), through :mod:`pipeline.driver.runner`.
"""

from __future__ import annotations

import os
import shlex
import socket
import time
from pathlib import Path
from typing import Any

from pipeline.rundir.layout import RunLayout
from pipeline.rundir.runs import DEFAULT_ROOT
from pipeline.storage.atomic import clear_file, is_temp_name, read_json, write_json_atomic
from pipeline.storage.integrity import lstat_kind


def resume_command(layout: RunLayout) -> str:
    """The command that continues the run (said after an interrupt or failure, and by the status view)."""
    cmd = f"python -m pipeline run.id={layout.run_id}"
    root = layout.run_dir.parent.parent
    if root != Path(DEFAULT_ROOT).resolve():
        cmd += f" run.root={shlex.quote(str(root))}"
    return cmd


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def sweep_record_litter(layout: RunLayout) -> None:
    """Remove temp files of stage records that a task left when it died mid-write. Only the launching process
    calls this, holding the run's lease and before any job starts, so no writer can be alive."""
    if lstat_kind(layout.stages) != "dir":
        return
    for p in layout.stages.iterdir():
        if is_temp_name(p.name) and lstat_kind(p) == "file":
            clear_file(p)


def read_record(layout: RunLayout, stage: str) -> dict[str, Any] | None:
    path = layout.stage_record(stage)
    if not path.exists():
        return None
    rec = read_json(path)
    return rec if isinstance(rec, dict) else None


def write_record(layout: RunLayout, stage: str, **fields: Any) -> dict[str, Any]:
    rec = read_record(layout, stage) or {}
    if _earlier_run(fields, rec):  # a ghost of the job's earlier run (back from a cut-off node) writes late
        return rec
    if fields.get("status") == "running":
        rec = {}  # a new attempt starts a fresh record
    rec.update(fields)
    rec.setdefault("stage", stage)
    rec.setdefault("host", socket.gethostname())
    rec.setdefault("nodes", job_nodes())
    rec.setdefault("pid", os.getpid())
    write_json_atomic(layout.stage_record(stage), rec)
    return rec


def _verdict(layout: RunLayout, stage: str, job_id: str, run: int) -> str | None:
    """How job ``job_id`` ended (``succeeded``/``failed``) by the stage's record, where its run ``run`` or a later
    one wrote it: not a ghost of an earlier run (a process on a node cut off, back after SLURM requeued it)."""
    rec = read_record(layout, stage) or {}
    written_by = rec.get("restart")
    written_by = written_by if isinstance(written_by, int) else 0
    status = rec.get("status")
    return status if rec.get("job_id") == job_id and status in ("succeeded", "failed") and written_by >= run else None


def has_verdict(layout: RunLayout, stage: str, job_id: str, run: int) -> bool:
    """The stage's record says how job ``job_id`` ended, written by its run ``run`` or a later one."""
    return _verdict(layout, stage, job_id, run) is not None


def succeeded_by(layout: RunLayout, stage: str, job_id: str, run: int) -> bool:
    """The stage's record says job ``job_id`` succeeded, written by its run ``run`` or a later one: what a result
    file a ghost overwrote (the cut-off earlier run of the same job, ending with an error once its node is back)
    does not undo."""
    return _verdict(layout, stage, job_id, run) == "succeeded"


def ghost_result(layout: RunLayout, stage: str, act: Any, error: Any, say: Any) -> Any:
    """``error``, or None when it is a ghost's: the requeued run of ``act``'s job recorded its success, and the
    job's one result file, shared by its runs, holds the error the cut-off run wrote after it (said in one line)."""
    job_id, again = act.handle.job_id, act.requeued
    if error is None or again is None or not again.nodes or not succeeded_by(layout, stage, job_id, again.restarts):
        return error
    say(f"     {stage}: job {job_id}'s requeued run (restart {again.restarts}) recorded its success; the error in "
        f"its result file is the cut-off run's on {again.nodes} (a ghost): {str(error).splitlines()[0]}")  # fmt: skip
    return None


def slurm_restart() -> int:
    """Which run of its SLURM job this process belongs to: 0 for the first, n after SLURM requeued it n times
    (``SLURM_RESTART_COUNT``); 0 off SLURM."""
    value = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def _earlier_run(fields: dict[str, Any], rec: dict[str, Any]) -> bool:
    """The record already belongs to a later run of the same job than the writer's (best effort only: a reader
    that must not take a ghost's verdict compares ``restart`` itself)."""
    mine, theirs = fields.get("restart"), rec.get("restart")
    same_job = fields.get("job_id") is not None and fields.get("job_id") == rec.get("job_id")
    return same_job and isinstance(mine, int) and isinstance(theirs, int) and theirs > mine


def job_nodes() -> str:
    """The nodes this stage's job runs on: SLURM's node list of the job (``node[1-2]``), else this host's name."""
    return os.environ.get("SLURM_JOB_NODELIST") or socket.gethostname()


def pid_alive(pid: int) -> bool:
    """A process with this pid exists on this host (someone else's counts: PermissionError)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stage_alive(layout: RunLayout, stage: str) -> bool:
    """Liveness for waits on a stage's output: its record says running, and its process still exists."""
    rec = read_record(layout, stage)
    if rec is None or rec.get("status") != "running":
        return False
    if rec.get("host") == socket.gethostname():
        pid = int(rec.get("pid", 0))
        return pid > 0 and pid_alive(pid)
    return True  # another host: trust the record (the launcher's job state is the authority there)


def producer_attempt(layout: RunLayout, stage: str) -> str | None:
    """The attempt whose markers a reader must wait for: the running attempt of ``stage``, or None when no attempt
    of it runs (then any one complete attempt counts; see ``checkpoint.manifest.complete_markers``)."""
    if not stage_alive(layout, stage):
        return None
    attempt = (read_record(layout, stage) or {}).get("attempt")
    return attempt if isinstance(attempt, str) else None
