"""Where this run's checkpoints live: the run dir (default) or a bucket (``checkpoint.storage=s3://...``).

With a bucket, the run dir (records, lease, logs, metrics, outputs) stays on the shared filesystem and the
checkpoints (staging, committed steps, ``latest``, quarantine, retention) live under
``s3://<bucket>/<prefix>/<experiment>/<run_id>/``. Stages that read a committed step (resume, consolidate,
export) first :func:`pull` it: a verified copy of the step ``latest`` names into ``checkpoints/`` of the run dir,
which their local readers then use unchanged; ``is_done`` checks read the bucket's ``latest`` (read-only).
"""

from __future__ import annotations

from pipeline.checkpoint.manifest import Latest
from pipeline.checkpoint.stores.remote import Remote
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.config.schema import PipelineConfig
from pipeline.rundir.layout import RunLayout
from pipeline.rundir.store import run_remote, run_store


def remote(cfg: PipelineConfig, layout: RunLayout) -> Remote | None:
    """The run's checkpoints root in its bucket (decided by the config and the run id: never per rank)."""
    return run_remote(cfg.checkpoint.storage, layout)


def store(cfg: PipelineConfig, layout: RunLayout) -> CheckpointStore:
    """The run's checkpoints: in its bucket, else in its run dir."""
    return run_store(cfg.checkpoint.storage, layout)


def committed_latest(cfg: PipelineConfig, layout: RunLayout) -> Latest | None:
    """``latest`` with its manifest checked (not its files): the bucket's, or the run dir's."""
    return store(cfg, layout).read_latest()


def pull(cfg: PipelineConfig, layout: RunLayout) -> None:
    """With a bucket: a verified local copy of the step ``latest`` names in ``checkpoints/`` (nothing otherwise)."""
    store(cfg, layout).local()
