"""verify-manifest: the one task that commits checkpoints (the library's :class:`Committer`, run as a job).

Inputs: ``checkpoints/staging/step_N/`` with each rank's ``rank_K.done.json``; the train record (attempt,
liveness).
Outputs: ``checkpoints/step_N/manifest.json`` and the step published by one directory rename, then
``checkpoints/latest`` replaced atomically; staged steps that fail verification move to
``checkpoints/quarantine/`` (never deleted) and the error names the file.
Owner: this single task; no rank ever publishes or moves ``latest``.
Done-marker: ``latest`` names a step whose manifest verifies, and no newer step is staged.

Beside train (its job is handed in as ``ctx.beside``; SLURM starts this job once train's has started), every
step is committed as soon as all its markers are there, so ``latest`` advances while train runs; once train's
job has ended (the scheduler says so, or its record for this attempt has), a last pass commits whatever is
complete, waiting for missing markers until ``checkpoint.marker_deadline_s`` while train is alive. The commit
algorithm, the repairs of a damaged ``latest`` and retention live in :mod:`pipeline.checkpoint.protocol.committer`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pipeline.stagekit.checkpoint_store as storage
from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer
from pipeline.checkpoint.stores.stores import store_for
from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import JobRef, Resources, StageContract, TaskContext
from pipeline.stagekit.jobs import LOCAL_CLUSTERS, job_alive
from pipeline.stagekit.records import producer_attempt, read_record, stage_alive
from pipeline.storage.integrity import is_real_dir
from pipeline.workload.size import RECORD_BYTES, save_count

CONTRACT = StageContract(
    name="verify_manifest",
    needs=("train", "import_checkpoint"),
    reads="checkpoints/staging/step_N/ + rank_K.done.json",
    produces="checkpoints/step_N/ (manifest.json), checkpoints/latest, checkpoints/quarantine/",
    marker="checkpoints/latest + manifest.json",
    resources=Resources(cpus_per_task=1, mem_gb=2, timeout_min=30),
    after_any=True,
    beside="train",
    writes_bytes=lambda cfg: RECORD_BYTES * (1 + save_count(cfg)),  # manifests and latest
    # Beside train: one train job plus its own last pass, not train's limit times its requeues (days that
    # partitions refuse). On SLURM it is requeued at its limit, as train is; and the launcher starts it again
    # when it ends while train runs (launchers/submitit_launcher.py, pipeline/driver/supervise.py).
    sized_by=lambda cfg: Resources(cpus_per_task=1, mem_gb=2, timeout_min=cfg.train.time_limit_min + 30),
)
PRODUCER = CONTRACT.needs[0]
"""The stage whose staged steps this one commits (train): its record gives the attempt and liveness."""

log = logging.getLogger(__name__)


def policy(cfg: PipelineConfig) -> CommitPolicy:
    """The app's config as the committer's policy."""
    ck = cfg.checkpoint
    return CommitPolicy(
        world_size=cfg.strategy.world_size,
        marker_deadline_s=ck.marker_deadline_s,
        poll_interval_s=cfg.launcher.poll_interval_s,
        allow_pickle=cfg.import_.allow_pickle,
        keep_last=ck.keep_last,
        keep_every=ck.keep_every,
        keep_outputs_last=ck.keep_outputs_last,
        keep_best=ck.keep_best,
        best_metric=ck.best_metric,
        best_mode=ck.best_mode,
    )


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    if not is_real_dir(layout.staging):
        raise PipelineError(
            f"{layout.staging} is missing or not a directory: run stage=prepare_dirs for run {layout.run_id} first"
        )


def committer(cfg: PipelineConfig, layout: RunLayout, **kw: Any) -> Committer:
    """The run's committer: of the run dir's ``checkpoints/``, or of its bucket (``checkpoint.storage``)."""
    return Committer(layout, policy(cfg), store_for(layout, storage.remote(cfg, layout)), **kw)


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    try:
        step = committer(cfg, layout).is_clean()
    except PipelineError:  # a bucket that does not answer: the job finds out and says so
        return None
    if step is None:
        return None
    return f"latest is step {step}, its manifest verifies, and nothing newer is staged"


def _save_errors(layout: RunLayout) -> dict[int, str]:
    """Why train's ranks could not save a step, as its record says (the cause behind a missing marker)."""
    summary = (read_record(layout, PRODUCER) or {}).get("summary")
    errors = summary.get("save_errors") if isinstance(summary, dict) else None
    if not isinstance(errors, dict):
        return {}
    return {int(k): str(v) for k, v in errors.items() if str(k).isdigit()}


def _producer_alive(ctx: TaskContext) -> bool:
    """Beside train: its job is queued, running or requeued (the scheduler says so; unknown counts as alive),
    and its record for this attempt has not ended."""
    ref = ctx.beside
    if ref is None:
        return stage_alive(ctx.layout, PRODUCER)
    rec = read_record(ctx.layout, ref.stage) or {}
    if rec.get("attempt") == ref.attempt and rec.get("status") in ("succeeded", "interrupted"):
        return False
    if rec.get("attempt") == ref.attempt and rec.get("status") == "failed":
        # A rank failed: on one node the attempt is over. On a scheduler the job may be requeued instead (a node
        # failure: NODE_FAIL, then the same job queued again, resuming from latest); follow it while the
        # scheduler, asked afresh, still has it queued or running.
        return ref.cluster not in LOCAL_CLUSTERS and _scheduler.alive(ref, max_age_s=_FAILED_POLL_S)
    # A local job's controller may be gone while its ranks still finish (a cancel): rank 0's record counts too.
    return _job_alive_cached(ref) or (rec.get("attempt") == ref.attempt and stage_alive(ctx.layout, ref.stage))


_SCHEDULER_POLL_S = 15.0
"""How often the committer asks a scheduler about train's job (squeue/sacct per poll would load slurmctld);
train's record, read every poll, says at once when train has ended."""


_FAILED_POLL_S = 2.0
"""How often the committer asks the scheduler about a train job whose record says failed (it ends, or SLURM
requeues it after a node failure, within seconds)."""


class _SchedulerCache:
    """``job_alive`` (unknown counts as alive) per job; a scheduler is asked at most every ``_SCHEDULER_POLL_S``."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[float, bool]] = {}

    def alive(self, ref: JobRef, max_age_s: float = _SCHEDULER_POLL_S) -> bool:
        if ref.cluster in LOCAL_CLUSTERS:  # a pid check: cheap
            return job_alive(ref.cluster, ref.job_id) is not False
        key = f"{ref.cluster}:{ref.job_id}"
        asked = self.answers.get(key)
        if asked is None or time.monotonic() - asked[0] >= max_age_s:
            asked = (time.monotonic(), job_alive(ref.cluster, ref.job_id) is not False)
            self.answers[key] = asked
        return asked[1]


_scheduler = _SchedulerCache()


def _job_alive_cached(ref: JobRef) -> bool:
    return _scheduler.alive(ref)


def run(ctx: TaskContext) -> dict[str, object]:
    layout = ctx.layout
    c = committer(ctx.cfg, layout, save_errors=lambda: _save_errors(layout))
    with c.hold(takeover=True):  # the run's one committer job: a stale holder (its ghost) is fenced off
        if ctx.beside is None:
            c.recover()
        else:
            c.recover_or_defer()  # the store away now: follow recovers before its next pass
            c.follow(alive=lambda: _producer_alive(ctx))
        c.finish(producer_attempt(layout, PRODUCER), alive=lambda: stage_alive(layout, PRODUCER))
        c.raise_problems()
    committed = c.report.committed
    return {
        "committed": list(committed),
        "latest": c.latest_step(),
        "committed_at": {str(k): v for k, v in committed.items()},
    }
