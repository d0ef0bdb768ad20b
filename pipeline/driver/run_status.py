"""What ``python -m pipeline.status`` shows about a run, gathered read-only from its files and the scheduler.

:func:`collect` reads the run's record, lease, stage records, checkpoints and outputs into one JSON-able dict
(what ``--json`` prints); :func:`render` turns that dict into aligned lines for a terminal. Nothing here writes,
locks or repairs anything: a damaged file becomes a line (or an ``error`` field) saying so, never a traceback.
Listings only nominate: a committed step's size comes from its manifest, never from walking its files.
"""

from __future__ import annotations

import calendar
import re
import socket
import time
from pathlib import Path
from typing import Any

from pipeline.checkpoint.fast import RESUMED_FILE
from pipeline.checkpoint.protocol.retention import output_areas
from pipeline.checkpoint.steps import pick
from pipeline.checkpoint.stores.posix_status import read_json as _read_json
from pipeline.checkpoint.stores.posix_status import step_entries as _step_entries
from pipeline.checkpoint.stores.posix_status import why as _why
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.checkpoint.stores.stores import committer_running, library_store, live_holder
from pipeline.driver.lease import read_lease
from pipeline.errors import PipelineError
from pipeline.rundir.layout import RunLayout
from pipeline.rundir.runs import read_run_yaml
from pipeline.rundir.store import run_store
from pipeline.stagekit import jobs
from pipeline.stagekit.contract import OPTIONAL, ORDER
from pipeline.stagekit.records import pid_alive, resume_command, stage_alive
from pipeline.storage.integrity import lstat_kind
from pipeline.storage.layout import CheckpointLayout

Status = dict[str, Any]


def _config(layout: RunLayout) -> tuple[dict[str, Any], str | None]:
    try:
        return read_run_yaml(layout.run_yaml).config, None
    except PipelineError as e:
        return {}, _why(e)


def _owner(layout: RunLayout) -> tuple[dict[str, Any] | None, str | None]:
    try:
        lease = read_lease(layout)
    except (PipelineError, OSError) as e:
        return None, _why(e)
    if lease is None:
        return None, None
    here = lease["host"] == socket.gethostname()
    owner = {k: lease[k] for k in ("pid", "host", "started", "command")}
    owner["alive"] = pid_alive(lease["pid"]) if here else None
    owner["handed_over"] = lease["handed_over"] if isinstance(lease.get("handed_over"), str) else None
    owner["jobs"] = [
        {k: str(j.get(k)) for k in ("stage", "job_id", "cluster", "host") if j.get(k) is not None}
        for j in lease["jobs"]
    ]
    return owner, None


def _elapsed(started: Any) -> float | None:
    try:
        return max(0.0, time.time() - calendar.timegm(time.strptime(str(started), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


def _logs(layout: RunLayout, stage: str, job_id: str | None) -> tuple[str | None, list[str]]:
    """``logs/<stage>/<job_id>/`` (submitit's folder) and its ``*_log.err`` files."""
    if not job_id or job_id == "inprocess" or not re.fullmatch(r"[0-9A-Za-z_.-]+", job_id) or job_id in {".", ".."}:
        return None, []
    folder = layout.logs / stage / job_id
    try:
        errs = sorted(p.name for p in folder.glob("*_log.err")) if lstat_kind(folder) == "dir" else []
    except OSError:
        errs = []
    return str(folder), errs


def _stage(layout: RunLayout, stage: str, clusters: dict[tuple[str, str], str], default_cluster: str) -> Status:
    rec, problem = _read_json(layout.stage_record(stage), "stage record")
    if problem is not None or (rec is not None and not isinstance(rec, dict)):
        return {"stage": stage, "state": "unreadable", "error": problem or "stage record is not a JSON object"}
    if rec is None:
        return {"stage": stage, "state": "never ran"}
    job_id = str(rec["job_id"]) if rec.get("job_id") is not None else None
    cluster = "inprocess" if job_id == "inprocess" else clusters.get((stage, job_id or ""))
    out: Status = {"stage": stage, "state": str(rec.get("status") or "unknown")}
    for key in ("attempt", "host", "nodes", "pid", "started", "ended", "seconds", "signal"):
        if rec.get(key) is not None:
            out[key] = rec[key]
    out["job_id"], out["cluster"] = job_id, cluster or rec.get("cluster") or default_cluster
    if isinstance(rec.get("error"), str):
        out["error"] = rec["error"].strip().splitlines()[0] if rec["error"].strip() else ""
    out["log_dir"], out["log_files"] = _logs(layout, stage, job_id)
    return out


def _judge_running(layout: RunLayout, st: Status, slurm: dict[str, str]) -> None:
    """Whether a stage its record calls running still runs: the scheduler (SLURM) or the pid (local) says."""
    if st["cluster"] == "slurm":
        state = slurm.get(st.get("job_id") or "")
        st["slurm_state"] = state
        if st["state"] == "running" and state is not None and state not in jobs.ACTIVE_STATES:
            st["state"] = "died"
        return
    if st["state"] != "running":
        return
    if st.get("host") not in (None, socket.gethostname()):
        st["note"] = f"on host {st['host']}: not checked from here"
        return
    try:
        alive = stage_alive(layout, st["stage"])
    except (PipelineError, OSError, ValueError, TypeError):
        alive = False
    if not alive:
        st["state"] = "died"


def _outputs(area: Path, marker: str) -> list[Status]:
    return [
        {"step": step, "complete": lstat_kind(area / name / marker) == "file"}
        for name, step in _step_entries(area)
        if lstat_kind(area / name) == "dir"
    ]


def _store(layout: CheckpointLayout) -> CheckpointStore:
    """Where the checkpoints are: a run's (``checkpoint.storage`` in ``run.yaml``: its bucket, else the run dir),
    or a library dir's (the bucket its ``checkpoints/storage.json`` names, else the dir)."""
    if isinstance(layout, RunLayout):
        ck = _config(layout)[0].get("checkpoint")
        url = ck.get("storage") if isinstance(ck, dict) else None
        return run_store(url if isinstance(url, str) else None, layout)
    return library_store(layout)


def _checkpoints(layout: CheckpointLayout, world_size: int | None) -> Status:
    try:
        store = _store(layout)
    except PipelineError as e:
        return {"latest": None, "latest_error": str(e), "unreadable": str(e), "committed": [], "staged": [],
                "quarantined": []}  # fmt: skip
    out = store.describe(world_size)
    out["resumed"], out["resumed_error"] = _read_json(layout.checkpoints / RESUMED_FILE, "resume record")
    return out


def collect(layout: RunLayout) -> Status:
    """Everything the status view shows, as one JSON-able dict."""
    config, config_error = _config(layout)
    owner, owner_error = _owner(layout)
    lease_jobs = owner["jobs"] if owner else []
    clusters = {(j.get("stage", ""), j.get("job_id", "")): j.get("cluster", "") for j in lease_jobs}
    launcher, strategy = config.get("launcher"), config.get("strategy")
    default_cluster = str(launcher.get("kind", "local")) if isinstance(launcher, dict) else "local"
    world_size = strategy.get("world_size") if isinstance(strategy, dict) else None
    # A training run never imports: its import stage (which has no record then) is not listed.
    shown = [s for s in ORDER if s not in OPTIONAL or layout.stage_record(s).exists()]
    stages = [_stage(layout, s, clusters, default_cluster) for s in shown]
    slurm_ids = [j["job_id"] for j in lease_jobs if j.get("cluster") == "slurm"]
    slurm_ids += [str(s["job_id"]) for s in stages if s.get("cluster") == "slurm" and s.get("job_id")]
    slurm = jobs.slurm_states(slurm_ids) if slurm_ids else {}
    for st in stages:
        if "cluster" in st:
            _judge_running(layout, st, slurm)
        if st["state"] == "running":
            st["running_for_s"] = _elapsed(st.get("started"))
    for job in lease_jobs:
        job["state"] = _job_state(job, slurm)
    if owner is not None:
        owner["state"] = _owner_state(owner)
    return {
        "run_id": layout.run_id,
        "run_dir": str(layout.run_dir),
        "experiment": layout.run_dir.parent.name,
        "run_yaml_error": config_error,
        "owner": owner,
        "owner_error": owner_error,
        "stages": stages,
        "checkpoints": _checkpoints(layout, world_size if type(world_size) is int else None),
        "consolidated": _outputs(*output_areas(layout)["consolidated"]),
        "exported": _outputs(*output_areas(layout)["export"]),
        "resume": resume_command(layout),
    }


def _owner_state(owner: Status) -> str:
    """``alive`` (the launch runs), ``jobs`` (it is gone, its jobs hold the run), ``ended`` (its jobs have all
    ended, and it either handed the run to them or was a SLURM launch: nobody owns the run), ``other host`` (the
    launch ran elsewhere: no pid to check), ``stale`` (a launch that died, without jobs that outlive it).

    A SLURM launch without ``launcher.wait`` exits once it has submitted the chain and leaves its lease to the jobs
    (see :mod:`pipeline.driver.lease`): after a normal finish the lease is still there, its pid gone."""
    if owner["alive"] is True:
        return "alive"
    states = [str(j.get("state")) for j in owner["jobs"]]
    if any(s in jobs.ACTIVE_STATES or s in ("running", "unknown") for s in states):
        return "jobs" if owner["alive"] is False or owner["handed_over"] else "other host"
    left_to_jobs = owner["handed_over"] or any(j.get("cluster") == "slurm" for j in owner["jobs"])
    if states and left_to_jobs:
        return "ended"
    return "other host" if owner["alive"] is None else "stale"


def _job_state(job: dict[str, str], slurm: dict[str, str]) -> str:
    if job.get("cluster") == "slurm":
        return slurm.get(job.get("job_id", ""), "unknown")
    if job.get("host") != socket.gethostname():
        return "unknown"
    alive = jobs.job_alive(job.get("cluster", ""), job.get("job_id", ""))
    return {True: "running", False: "ended", None: "unknown"}[alive]


# --- text view ---------------------------------------------------------------------------------------------------


def _committer_line(layout: CheckpointLayout) -> str | None:
    """Who commits these checkpoints now, as its lease record says (any node, in the dir or the bucket), or None."""
    try:
        held = live_holder(_store(layout))
    except (PipelineError, OSError):  # a bucket that does not answer: the checkpoints' own error says so
        return None
    return held.describe(time.time()) if held is not None else None


def _committer_running(layout: CheckpointLayout) -> bool:
    try:
        return committer_running(_store(layout))
    except (PipelineError, OSError):
        return False


def verify_steps(layout: CheckpointLayout, only: int | None = None) -> list[Status]:
    """``--verify``: every committed step's files (or step ``only``'s) re-hashed against its manifest, read in place
    (in a bucket nothing is cached), nothing changed: ``{"step", "ok", "error"}`` per step, the error naming the
    damaged file."""
    store = _store(layout)
    out: list[Status] = []
    for step in store.committed() if only is None else [only]:
        try:
            store.verify_committed(step)
            out.append({"step": step, "ok": True, "error": None})
        except (PipelineError, OSError) as e:
            out.append({"step": step, "ok": False, "error": _why(e)})
    return out


def collect_checkpoints(layout: CheckpointLayout) -> Status:
    """A checkpoint dir written by the library (a ``torchrun`` script's ``Checkpointer``): no run.yaml, no stage
    records; its checkpoints and outputs as the run view shows them."""
    return {
        "run_id": layout.run_id,
        "run_dir": str(layout.run_dir),
        "library": True,
        "committer_running": _committer_running(layout),
        "committer": _committer_line(layout),
        "checkpoints": _checkpoints(layout, None),
        "consolidated": _outputs(*output_areas(layout)["consolidated"]),
        "exported": _outputs(*output_areas(layout)["export"]),
        "resume": "run the training script again (Checkpointer.load_latest resumes from latest)",
    }


def chosen_step(layout: CheckpointLayout, which: int | str, metric: str, mode: str) -> Status:
    """``--step N`` / ``--best``: that committed step and its recorded metrics (a PipelineError naming the
    committed steps when there is no such step)."""
    store = _store(layout)
    step = pick(store, which, metric, mode)
    return {"step": step, "asked": which, "metrics": store.step_metrics(step), "manifest": store.manifest_where(step)}
