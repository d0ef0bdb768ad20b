"""verify-manifest: the one task that commits checkpoints.

Inputs: ``checkpoints/staging/step_N/`` with each rank's ``rank_K.done.json``; the train record (attempt,
liveness).
Outputs: ``checkpoints/step_N/manifest.json`` and the step published by one directory rename, then
``checkpoints/latest`` replaced atomically. Staged steps whose files fail their marker's size or hash move to
``checkpoints/quarantine/`` (never deleted), and the error names the file.
Owner: this single task; no rank ever publishes or moves ``latest``.
Done-marker: ``latest`` names a step whose manifest verifies, and no newer step is staged.

Waiting: markers are polled until ``checkpoint.marker_deadline_s`` while the train job is alive; once it is
not, a last look decides, and the error names the step and the missing ranks.
"""

from __future__ import annotations

import logging
import time

from pipeline.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    Marker,
    read_latest,
    read_marker,
    verify_committed,
    write_latest,
    write_manifest,
)
from pipeline.config.schema import PipelineConfig
from pipeline.errors import DeadlineError, PipelineError, VerificationError
from pipeline.orchestration.contract import Resources, StageContract, TaskContext
from pipeline.orchestration.records import read_record, stage_alive
from pipeline.storage.atomic import move_aside, publish_dir, write_json_atomic
from pipeline.storage.faults import inject
from pipeline.storage.integrity import hash_file, verify_entries
from pipeline.storage.layout import RunLayout, parse_step, step_name
from pipeline.storage.waiting import wait_until

CONTRACT = StageContract(
    name="verify_manifest",
    needs=("train",),
    reads="checkpoints/staging/step_N/ + rank_K.done.json",
    produces="checkpoints/step_N/ (manifest.json), checkpoints/latest, checkpoints/quarantine/",
    marker="checkpoints/latest + manifest.json",
    resources=Resources(cpus_per_task=1, mem_gb=2, timeout_min=30),
    after_any=True,
)
PRODUCER = CONTRACT.needs[0]
"""The stage whose staged steps this one commits (train): its record gives the attempt and liveness."""

log = logging.getLogger(__name__)


def _latest_step(layout: RunLayout) -> int:
    latest = read_latest(layout)
    return latest.step if latest else 0


def _candidates(layout: RunLayout, after: int) -> list[int]:
    # The listing only nominates candidates; completeness is decided by the markers' contents.
    if not layout.staging.is_dir():
        return []
    steps = (parse_step(p.name) for p in layout.staging.iterdir() if p.is_dir())
    return sorted(s for s in steps if s is not None and s > after)


def _published_after(layout: RunLayout, after: int) -> list[int]:
    """Steps published (renamed out of staging) but not yet named by ``latest``: a crash between the two."""
    steps = (parse_step(p.name) for p in layout.checkpoints.iterdir() if p.is_dir())
    return sorted(s for s in steps if s is not None and s > after and (layout.committed_step(s) / MANIFEST).exists())


def _finish_interrupted_commits(layout: RunLayout, after: int) -> list[int]:
    done = []
    for step in _published_after(layout, after):
        step_dir = layout.committed_step(step)
        verify_committed(step_dir)
        write_latest(layout, step, hash_file(step_dir / MANIFEST))
        log.warning("step %d was published but latest was not moved (interrupted commit): latest -> %d", step, step)
        done.append(step)
    return done


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    if not layout.staging.is_dir():
        raise PipelineError(f"{layout.staging} does not exist: run stage=prepare_dirs for run {layout.run_id} first")
    read_latest(layout)  # raises if latest is corrupt


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    try:
        latest = read_latest(layout)
    except (VerificationError, OSError, ValueError):
        return None
    if latest is None or _candidates(layout, latest.step) or _published_after(layout, latest.step):
        return None
    try:
        verify_committed(layout.committed_step(latest.step))
    except (VerificationError, OSError):
        return None
    return f"latest is step {latest.step}, its manifest verifies, and nothing newer is staged"


def _markers(cfg: PipelineConfig, layout: RunLayout, step: int, attempt: str | None) -> list[Marker | None]:
    staged = layout.staged_step(step)
    out: list[Marker | None] = []
    for rank in range(cfg.strategy.world_size):
        m = read_marker(staged, rank)
        if m is not None and m.rank != rank:
            raise VerificationError(
                f"{staged}/rank_{rank}.done.json claims rank {m.rank}: a marker must name its own rank"
            )
        if m is not None and ((attempt is not None and m.attempt != attempt) or m.step != step):
            m = None  # stale: left by an older attempt of train
        out.append(m)
    return out


def _wait_for_markers(cfg: PipelineConfig, layout: RunLayout, step: int, attempt: str | None) -> list[Marker]:
    def poll() -> list[Marker] | None:
        ms = _markers(cfg, layout, step, attempt)
        return [m for m in ms if m is not None] if all(m is not None for m in ms) else None

    def missing() -> str:
        ranks = [str(r) for r, m in enumerate(_markers(cfg, layout, step, attempt)) if m is None]
        where = layout.staged_step(step)
        return f"step {step}: rank(s) {', '.join(ranks)} wrote no done-marker in {where} (rank_<K>.done.json)"

    return wait_until(
        poll,
        deadline_s=cfg.checkpoint.marker_deadline_s,
        what=missing,
        alive=lambda: stage_alive(layout, PRODUCER),
    )


def _commit(ctx: TaskContext, step: int, markers: list[Marker]) -> str:
    layout = ctx.layout
    staged = layout.staged_step(step)
    world = {m.world_size for m in markers}
    attempts = {m.attempt for m in markers}
    if world != {ctx.cfg.strategy.world_size} or len(attempts) != 1:
        raise VerificationError(
            f"markers of step {step} in {staged} disagree: world sizes {sorted(world)} "
            f"(expected {ctx.cfg.strategy.world_size}), attempts {sorted(attempts)}"
        )
    files = tuple(f for m in markers for f in m.files)
    paths = [f.path for f in files]
    dupes = sorted({p for p in paths if paths.count(p) > 1})
    if dupes:
        raise VerificationError(
            f"markers of step {step} in {staged} claim the same file(s) {dupes}: files are rank-private"
        )
    for m in markers:
        verify_entries(staged, list(m.files), str(staged / f"rank_{m.rank}.done.json"))
    manifest = Manifest(
        step=step,
        world_size=markers[0].world_size,
        format=markers[0].format,
        attempt=markers[0].attempt,
        run_id=layout.run_id,
        files=files,
    )
    manifest_hash = write_manifest(staged, manifest)
    inject("verify.before_publish", step=step)
    publish_dir(staged, layout.committed_step(step))
    inject("verify.before_latest", step=step)
    write_latest(layout, step, manifest_hash)
    log.info("committed step %d (%d files) -> %s", step, len(files), layout.committed_step(step))
    return manifest_hash


def run(ctx: TaskContext) -> dict[str, object]:
    cfg, layout = ctx.cfg, ctx.layout
    train_rec = read_record(layout, PRODUCER) or {}
    attempt = train_rec.get("attempt")
    committed: list[int] = []
    incomplete: list[tuple[int, str]] = []
    quarantined: list[str] = []
    committed += _finish_interrupted_commits(layout, _latest_step(layout))
    latest = _latest_step(layout)
    for step in _candidates(layout, latest):
        if layout.committed_step(step).exists():
            log.warning("step %d is staged again but already published; the staged copy is left alone", step)
            continue
        try:
            markers = _wait_for_markers(cfg, layout, step, attempt)
            _commit(ctx, step, markers)
            committed.append(step)
        except DeadlineError as e:
            incomplete.append((step, str(e)))
        except VerificationError as e:
            where = move_aside(layout.staged_step(step), layout.quarantine, f"{step_name(step)}.{int(time.time())}")
            write_json_atomic(where / "quarantine.json", {"step": step, "reason": str(e)})
            quarantined.append(f"step {step}: {e} (moved to {where})")
            log.error("QUARANTINED step %d: %s -> %s", step, e, where)
    newest = _latest_step(layout)
    pending = [msg for step, msg in incomplete if step > newest]
    if quarantined or pending:
        raise VerificationError("; ".join(quarantined + pending) + f" (latest stays at step {newest})")
    for step, msg in incomplete:
        log.warning("incomplete step %d is superseded by committed step %d; left in staging: %s", step, newest, msg)
    return {"committed": committed, "latest": newest}
