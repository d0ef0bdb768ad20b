"""Where this run's checkpoints live: the run dir (default) or a bucket (``checkpoint.storage=s3://...``).

With a bucket, the run dir (records, lease, logs, metrics, outputs) stays on the shared filesystem and the
checkpoints (staging, committed steps, ``latest``, quarantine, retention) live under
``s3://<bucket>/<prefix>/<experiment>/<run_id>/``. Stages that read a committed step (resume, consolidate,
export) first :func:`pull` it: a verified copy of the step ``latest`` names into ``checkpoints/`` of the run dir,
which their local readers then use unchanged; ``is_done`` checks read the bucket's ``latest`` (read-only).
"""

from __future__ import annotations

from pipeline.checkpoint.manifest import Latest, read_latest
from pipeline.checkpoint.remote import Remote, digest
from pipeline.config.schema import PipelineConfig
from pipeline.rundir.layout import RunLayout
from pipeline.storage.s3 import S3Url


def remote(cfg: PipelineConfig, layout: RunLayout) -> Remote | None:
    """The run's checkpoints root in its bucket (decided by the config and the run id: never per rank)."""
    url = cfg.checkpoint.storage
    if not url:
        return None
    root = S3Url.parse(url).join(layout.run_dir.parent.name, layout.run_id)
    return Remote(root=root, cache_dir=layout.run_dir)


def committed_latest(cfg: PipelineConfig, layout: RunLayout) -> Latest | None:
    """``latest`` with its manifest checked (not its files): the bucket's, or the run dir's."""
    r = remote(cfg, layout)
    if r is None:
        return read_latest(layout)
    found = r.verified_latest()
    return None if found is None else Latest(step=found[0].step, manifest_hash=digest(found[1]))


def pull(cfg: PipelineConfig, layout: RunLayout) -> None:
    """With a bucket: a verified local copy of the step ``latest`` names in ``checkpoints/`` (nothing otherwise)."""
    r = remote(cfg, layout)
    if r is not None:
        r.pull()
