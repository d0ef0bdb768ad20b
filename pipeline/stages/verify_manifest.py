"""verify-manifest: the one task that commits checkpoints.

Inputs: ``checkpoints/staging/step_N/`` with each rank's ``rank_K.done.json``; the train record (attempt,
liveness).
Outputs: ``checkpoints/step_N/manifest.json`` and the step published by one directory rename, then
``checkpoints/latest`` replaced atomically. Staged steps whose files fail their marker's size or hash move to
``checkpoints/quarantine/`` (never deleted), and the error names the file.
Owner: this single task; no rank ever publishes or moves ``latest``.
Done-marker: ``latest`` names a step whose manifest verifies, and no newer step is staged.

Beside train (its job is handed in as ``ctx.beside``; SLURM starts this job once train's has started), every
step is committed as soon as all its markers are there, so ``latest`` advances while train runs; once train's
job has ended (the scheduler says so, or its record for this attempt has), a last pass commits whatever is
complete. Steps a killed or requeued train left staged are committed first: train waits for them before it
decides where to resume.

Waiting: markers are polled until ``checkpoint.marker_deadline_s`` while the train job is alive; once it is
not, a last look decides, and the error names the step and the missing ranks. Which markers count is one rule
shared with train (:func:`~pipeline.checkpoint.manifest.complete_markers`).

Every run first re-verifies the step ``latest`` names. Damage there (a changed or missing file, a manifest that
is not the one ``latest`` recorded, garbage in ``latest`` itself) is moved to ``quarantine/``, ``latest`` goes
back to the newest committed step that verifies, and the stage fails naming the file, so the next launch
retrains from there. Nothing under ``checkpoints/`` is ever followed through a symlink: a link where a step
should be is quarantined, never published.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

from pipeline.checkpoint import retention
from pipeline.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    Marker,
    complete_markers,
    describe_incomplete,
    read_latest,
    staged_world,
    step_markers,
    verify_committed,
    write_latest,
    write_manifest,
)
from pipeline.config.schema import PipelineConfig
from pipeline.errors import DeadlineError, PipelineError, VerificationError
from pipeline.formats.registry import FORMATS, Format
from pipeline.orchestration.contract import JobRef, Resources, StageContract, TaskContext
from pipeline.orchestration.jobs import LOCAL_CLUSTERS, job_alive
from pipeline.orchestration.records import producer_attempt, read_record, stage_alive
from pipeline.storage.atomic import clear_file, is_temp_name, move_aside, publish_dir, write_json_atomic
from pipeline.storage.faults import inject
from pipeline.storage.integrity import (
    FileEntry,
    hash_file,
    is_real_dir,
    lstat_kind,
    read_record_json,
    verify_entries,
)
from pipeline.storage.layout import RunLayout, parse_step, step_name
from pipeline.storage.waiting import wait_until

CONTRACT = StageContract(
    name="verify_manifest",
    needs=("train", "import_checkpoint"),
    reads="checkpoints/staging/step_N/ + rank_K.done.json",
    produces="checkpoints/step_N/ (manifest.json), checkpoints/latest, checkpoints/quarantine/",
    marker="checkpoints/latest + manifest.json",
    resources=Resources(cpus_per_task=1, mem_gb=2, timeout_min=30),
    after_any=True,
    beside="train",
    # Beside train it lives as long as train and its requeues, plus its own last pass.
    sized_by=lambda cfg: Resources(
        cpus_per_task=1,
        mem_gb=2,
        timeout_min=cfg.train.time_limit_min * (1 + getattr(cfg.launcher, "max_num_timeout", 0)) + 30,
    ),
)
PRODUCER = CONTRACT.needs[0]
"""The stage whose staged steps this one commits (train): its record gives the attempt and liveness."""

log = logging.getLogger(__name__)


def _latest_step(layout: RunLayout) -> int:
    latest = read_latest(layout)
    return latest.step if latest else 0


def _step_entries(area: Path) -> list[tuple[int, Path]]:
    """``step_N`` entries of ``area`` (the listing only nominates; markers and manifests decide)."""
    if not is_real_dir(area):
        return []
    steps = ((parse_step(p.name), p) for p in area.iterdir())
    return sorted((s, p) for s, p in steps if s is not None)


def _candidates(layout: RunLayout, after: int) -> list[int]:
    return [s for s, _ in _step_entries(layout.staging) if s > after]


def _published_after(layout: RunLayout, after: int) -> list[int]:
    """Steps published (renamed out of staging) but not yet named by ``latest``: a crash between the two."""
    return [
        s
        for s, p in _step_entries(layout.checkpoints)
        if s > after and is_real_dir(p) and lstat_kind(p / MANIFEST) == "file"
    ]


def _check_published(layout: RunLayout, step: int, world_size: int) -> None:
    """A published step that ``latest`` does not vouch for yet: its files verify against its manifest, and the
    manifest says exactly what the step's own markers (published with it) say: no entry dropped or added."""
    # Files, and the manifest against the markers published with it. Its world size and format are its own: a
    # run may continue under another world size or strategy, so older steps keep theirs.
    verify_committed(layout.committed_step(step), step)


def _finish_interrupted_commits(layout: RunLayout, after: int, world_size: int) -> list[int]:
    done = []
    for step in _published_after(layout, after):
        step_dir = layout.committed_step(step)
        _check_published(layout, step, world_size)
        write_latest(layout, step, hash_file(step_dir / MANIFEST))
        log.warning("step %d was published but latest was not moved (interrupted commit): latest -> %d", step, step)
        done.append(step)
    return done


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    if not is_real_dir(layout.staging):
        raise PipelineError(
            f"{layout.staging} is missing or not a directory: run stage=prepare_dirs for run {layout.run_id} first"
        )


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    try:
        latest = read_latest(layout)
        if latest is None or _candidates(layout, latest.step) or _published_after(layout, latest.step):
            return None
        if _planted(layout):
            return None
        verify_committed(layout.committed_step(latest.step), latest.step)
    except (VerificationError, OSError, ValueError):
        return None
    return f"latest is step {latest.step}, its manifest verifies, and nothing newer is staged"


def _save_errors(layout: RunLayout) -> dict[int, str]:
    """Why train's ranks could not save a step, as its record says (the cause behind a missing marker)."""
    summary = (read_record(layout, PRODUCER) or {}).get("summary")
    errors = summary.get("save_errors") if isinstance(summary, dict) else None
    if not isinstance(errors, dict):
        return {}
    return {int(k): str(v) for k, v in errors.items() if str(k).isdigit()}


def _sweep_temp_files(layout: RunLayout) -> None:
    """Temp files a committer that died left in ``checkpoints/`` (e.g. ``latest.tmp-*``): this stage's own litter."""
    for p in layout.checkpoints.iterdir():
        if is_temp_name(p.name) and lstat_kind(p) == "file":
            log.info("removing %s, left by a commit that did not finish", p)
            clear_file(p)


def _planted(layout: RunLayout) -> list[Path]:
    """``step_N`` entries of ``checkpoints/`` or ``staging/`` that are not real directories (symlinks, files)."""
    return [p for area in (layout.checkpoints, layout.staging) for _, p in _step_entries(area) if not is_real_dir(p)]


def _quarantine(layout: RunLayout, path: Path, reason: str, step: int | None = None) -> Path:
    """Move ``path`` (a step dir, a planted link, a damaged ``latest``) into ``quarantine/``, with the reason."""
    where = move_aside(path, layout.quarantine, f"{path.name}.{int(time.time())}")
    note = where / "quarantine.json" if is_real_dir(where) else where.with_name(where.name + ".quarantine.json")
    write_json_atomic(note, {"path": str(path), "reason": reason, "step": step})
    log.error("QUARANTINED %s: %s -> %s", path, reason, where)
    return where


def _newest_verifying(layout: RunLayout, world_size: int) -> tuple[int, str] | None:
    """The newest published step whose files verify against its manifest and markers: (step, manifest hash)."""
    for step, path in reversed(_step_entries(layout.checkpoints)):
        try:
            _check_published(layout, step, world_size)
        except VerificationError as e:
            log.warning("committed step %d does not verify, not a candidate for latest: %s", step, e)
            continue
        return step, hash_file(path / MANIFEST)
    return None


def _recheck_latest(layout: RunLayout, world_size: int) -> list[str]:
    """Re-verify the step ``latest`` names; on damage quarantine it and point ``latest`` at the newest step that
    verifies (or remove ``latest`` if none does). Returns what was repaired, for the stage's error."""
    repairs = []
    for path in _planted(layout):
        where = _quarantine(layout, path, f"{path} is a {lstat_kind(path)}, not a step directory; never followed")
        repairs.append(f"{path} was a {lstat_kind(where)}, not a step directory (moved to {where})")
    try:
        latest = read_latest(layout)
        if latest is None:
            return repairs
        verify_committed(layout.committed_step(latest.step), latest.step)
        return repairs
    except VerificationError as e:
        problem = str(e)
    damaged = _latest_step_name(layout)
    step_damaged = damaged is not None and lstat_kind(layout.committed_step(damaged)) is not None
    if damaged is not None and step_damaged:
        where = _quarantine(layout, layout.committed_step(damaged), problem, damaged)
    else:
        where = _quarantine(layout, layout.latest, problem)
    fallback = _newest_verifying(layout, world_size)
    if fallback is None:
        clear_file(layout.latest)
        now = "latest removed (no committed step verifies)"
    else:
        write_latest(layout, *fallback)
        now = f"latest moved back to step {fallback[0]}" if step_damaged else f"latest rebuilt as step {fallback[0]}"
        now += ", the newest step that verifies"
    repairs.append(f"{now}: {problem} (moved to {where}); rerun to train again from there")
    return repairs


def _latest_step_name(layout: RunLayout) -> int | None:
    """The step a (possibly damaged) ``latest`` names, if it names one at all; used only to decide what to
    quarantine, never to load."""
    try:
        obj = read_record_json(layout.latest, "latest pointer")
    except (OSError, VerificationError):
        return None
    step = obj.get("step") if isinstance(obj, dict) else None
    return step if type(step) is int and step >= 0 and obj.get("dir") == step_name(step) else None


def _wait_for_markers(cfg: PipelineConfig, layout: RunLayout, step: int, attempt: str | None) -> list[Marker]:
    staged = layout.staged_step(step)

    def markers() -> list[Marker | None]:
        return step_markers(staged, step, staged_world(staged, step, cfg.strategy.world_size))

    def missing() -> str:
        return f"step {step}: {describe_incomplete(markers(), attempt)} in {staged} (rank_<K>.done.json)"

    return wait_until(
        lambda: complete_markers(markers(), attempt),
        deadline_s=cfg.checkpoint.marker_deadline_s,
        what=missing,
        alive=lambda: stage_alive(layout, PRODUCER),
    )


def _commit(ctx: TaskContext, step: int, markers: list[Marker]) -> str:
    layout = ctx.layout
    staged = layout.staged_step(step)
    world = {m.world_size for m in markers}
    attempts = {m.attempt for m in markers}
    if len(world) != 1 or len(markers) not in world or len(attempts) != 1:
        raise VerificationError(
            f"markers of step {step} in {staged} disagree: {len(markers)} markers, world sizes {sorted(world)}, "
            f"attempts {sorted(attempts)}"
        )
    formats = {m.format for m in markers}
    if len(formats) != 1 or not formats <= FORMATS.keys():
        raise VerificationError(
            f"markers of step {step} in {staged} name format(s) {sorted(formats)}; known: {sorted(FORMATS)}"
        )
    fmt = FORMATS[markers[0].format]
    files = tuple(f for m in markers for f in m.files)
    paths = [f.path for f in files]
    dupes = sorted(p for p, n in Counter(paths).items() if n > 1)
    if dupes:
        raise VerificationError(
            f"markers of step {step} in {staged} claim the same file(s) {dupes}: files are rank-private"
        )
    _verify_marked(staged, markers, fmt)
    # The format's own metadata (hashed above, so these are verified bytes) names every file holding data,
    # and how many ranks wrote them (read once: a DCP step's ranks follow from its file names).
    allow = ctx.cfg.import_.allow_pickle
    stored = fmt.stored_files(staged, allow)
    unlisted = sorted(stored - set(paths))
    if unlisted:
        raise VerificationError(
            f"step {step} in {staged}: {unlisted} hold checkpoint data but no marker lists them (a marker that "
            "lists fewer files than its rank wrote)"
        )
    written_by = fmt.world_size_of(staged, stored, allow)
    if written_by != markers[0].world_size:
        raise VerificationError(
            f"step {step} in {staged}: the {fmt.name} files were written by {written_by} ranks, the markers say "
            f"{markers[0].world_size}"
        )
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


def _verify_marked(staged: Path, markers: list[Marker], fmt: Format) -> None:
    """Each marker lists only files its rank owns, and every listed file has the size and hash it records.

    Marker by marker, the first problem wins, as if each marker were checked in turn (owners, then its files);
    the files are hashed together, several at once, up to the first marker that lists another rank's file.
    """
    entries: list[FileEntry] = []
    listed_in: list[str] = []
    for m in markers:
        foreign = [f.path for f in m.files if fmt.owner(f.path) not in (None, m.rank)]
        if foreign:
            verify_entries(staged, entries, listed_in)  # the markers before it come first
            raise VerificationError(
                f"{staged / f'rank_{m.rank}.done.json'} lists {foreign}, which {fmt.name} names as another rank's "
                "files: each rank lists only the files it owns"
            )
        entries.extend(m.files)
        listed_in.extend([str(staged / f"rank_{m.rank}.done.json")] * len(m.files))
    verify_entries(staged, entries, listed_in)


def _producer_alive(ctx: TaskContext) -> bool:
    """Beside train: its job is queued, running or requeued (the scheduler says so; unknown counts as alive),
    and its record for this attempt has not ended."""
    ref = ctx.beside
    if ref is None:
        return stage_alive(ctx.layout, PRODUCER)
    rec = read_record(ctx.layout, ref.stage) or {}
    if rec.get("attempt") == ref.attempt and rec.get("status") in ("succeeded", "failed", "interrupted"):
        return False
    # A local job's controller may be gone while its ranks still finish (a cancel): rank 0's record counts too.
    return _job_alive_cached(ref) or (rec.get("attempt") == ref.attempt and stage_alive(ctx.layout, ref.stage))


_SCHEDULER_POLL_S = 15.0
"""How often the committer asks a scheduler about train's job (squeue/sacct per poll would load slurmctld);
train's record, read every poll, says at once when train has ended."""
_scheduler_answer: dict[str, tuple[float, bool]] = {}


def _job_alive_cached(ref: JobRef) -> bool:
    """``job_alive`` (unknown counts as alive); a scheduler is asked at most every ``_SCHEDULER_POLL_S``."""
    if ref.cluster in LOCAL_CLUSTERS:  # a pid check: cheap
        return job_alive(ref.cluster, ref.job_id) is not False
    key = f"{ref.cluster}:{ref.job_id}"
    asked = _scheduler_answer.get(key)
    if asked is None or time.monotonic() - asked[0] >= _SCHEDULER_POLL_S:
        asked = (time.monotonic(), job_alive(ref.cluster, ref.job_id) is not False)
        _scheduler_answer[key] = asked
    return asked[1]


def _commit_while_running(ctx: TaskContext, committed: dict[int, float], quarantined: list[str]) -> None:
    """Beside train: commit each staged step as soon as every rank's marker is there and its files verify, so
    ``latest`` advances while train runs. Returns once train's job has ended (after one more look)."""
    cfg, layout = ctx.cfg, ctx.layout
    while True:
        alive = _producer_alive(ctx)
        for step in _candidates(layout, _latest_step(layout)):
            if lstat_kind(layout.committed_step(step)) is not None or not is_real_dir(layout.staged_step(step)):
                continue
            try:
                staged = layout.staged_step(step)
                world = staged_world(staged, step, cfg.strategy.world_size)
                markers = complete_markers(step_markers(staged, step, world), None)
            except VerificationError:
                continue  # damaged markers: the last pass, once train has ended, quarantines the step
            if markers is None:
                continue
            try:
                _commit(ctx, step, markers)
                committed[step] = time.time()
            except VerificationError as e:
                where = _quarantine(layout, layout.staged_step(step), str(e), step)
                quarantined.append(f"step {step}: {e} (moved to {where})")
            _retain(ctx)
        if not alive:
            return
        time.sleep(cfg.launcher.poll_interval_s)


def _retain(ctx: TaskContext) -> None:
    """Retention (``checkpoint.keep_last``/``keep_every``/``keep_outputs_last``) after a commit: this task owns
    ``checkpoints/``; it never touches ``latest``'s step, a newer one, or anything staged or quarantined."""
    retention.apply(ctx.layout, ctx.cfg.checkpoint, latest_step=_latest_step(ctx.layout) or None)


def run(ctx: TaskContext) -> dict[str, object]:
    cfg, layout = ctx.cfg, ctx.layout
    committed: dict[int, float] = {}  # step -> unix time of its commit (how far latest trailed train)
    incomplete: list[tuple[int, str]] = []
    _sweep_temp_files(layout)
    quarantined: list[str] = _recheck_latest(layout, cfg.strategy.world_size)
    for step in _finish_interrupted_commits(layout, _latest_step(layout), cfg.strategy.world_size):
        committed[step] = time.time()
    if ctx.beside is not None:
        _commit_while_running(ctx, committed, quarantined)
    attempt = producer_attempt(layout, PRODUCER)
    latest = _latest_step(layout)
    for step in _candidates(layout, latest):
        if lstat_kind(layout.committed_step(step)) is not None:
            log.warning("step %d is staged again but already published; the staged copy is left alone", step)
            continue
        try:
            markers = _wait_for_markers(cfg, layout, step, attempt)
            _commit(ctx, step, markers)
            committed[step] = time.time()
            _retain(ctx)
        except DeadlineError as e:
            incomplete.append((step, str(e)))
        except VerificationError as e:
            where = _quarantine(layout, layout.staged_step(step), str(e), step)
            quarantined.append(f"step {step}: {e} (moved to {where})")
    newest = _latest_step(layout)
    reported = _save_errors(layout)
    pending = [
        msg + (f" (train reported: {reported[s]})" if s in reported else "") for s, msg in incomplete if s > newest
    ]
    if quarantined or pending:
        raise VerificationError("; ".join(quarantined + pending) + f" (latest stays at step {newest})")
    for step, msg in incomplete:
        log.warning("incomplete step %d is superseded by committed step %d; left in staging: %s", step, newest, msg)
    return {"committed": list(committed), "latest": newest, "committed_at": {str(k): v for k, v in committed.items()}}
