"""The committer's repairs: what it does before committing anything new, so a crash or tampering anywhere
leaves the newest step that verifies as ``latest``.

* :func:`sweep_temp_files`: temp files a committer that died left in ``checkpoints/``;
* :func:`recheck_latest`: the step ``latest`` names is verified again; damage there (a changed or missing file,
  a manifest that is not the one ``latest`` recorded, garbage in ``latest`` itself), and ``step_N`` entries that
  are links or files, move to ``quarantine/`` (never deleted), and ``latest`` goes back to the newest step that
  verifies (or is removed if none does);
* :func:`quarantine`: a path moved aside with the reason beside it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pipeline.checkpoint.manifest import MANIFEST, read_latest, verify_committed, write_latest
from pipeline.errors import VerificationError
from pipeline.storage.atomic import is_temp_name, json_bytes
from pipeline.storage.backend import Storage
from pipeline.storage.integrity import hash_file, read_record_json
from pipeline.storage.layout import CheckpointLayout, parse_step, step_name

log = logging.getLogger(__name__)

QUARANTINE_NOTE = "quarantine.json"
"""Why an entry was quarantined: inside a quarantined directory, or beside anything else as ``<name>.<NOTE>``."""


def quarantine_note(where: Path, is_dir: bool) -> Path:
    """Where the reason of the quarantined ``where`` is written (read by ``status``)."""
    return where / QUARANTINE_NOTE if is_dir else where.with_name(f"{where.name}.{QUARANTINE_NOTE}")


def step_entries(storage: Storage, area: Path) -> list[tuple[int, Path]]:
    """``step_N`` entries of ``area`` (the listing only nominates; markers and manifests decide)."""
    steps = ((parse_step(name), area / name) for name in storage.list(area))
    return sorted((s, p) for s, p in steps if s is not None)


# -- repairs -----------------------------------------------------------------------------------------------


def sweep_temp_files(storage: Storage, layout: CheckpointLayout) -> None:
    """Temp files a committer that died left in ``checkpoints/`` (e.g. ``latest.tmp-*``): its own litter."""
    for name in storage.list(layout.checkpoints):
        path = layout.checkpoints / name
        if is_temp_name(name) and storage.kind(path) == "file":
            log.info("removing %s, left by a commit that did not finish", path)
            storage.delete_file(path)


def planted(storage: Storage, layout: CheckpointLayout) -> list[Path]:
    """``step_N`` entries of ``checkpoints/`` or ``staging/`` that are not real directories (links, files)."""
    areas = (layout.checkpoints, layout.staging)
    return [p for area in areas for _, p in step_entries(storage, area) if storage.kind(p) != "dir"]


def quarantine(storage: Storage, layout: CheckpointLayout, path: Path, reason: str, step: int | None = None) -> Path:
    """Move ``path`` (a step dir, a planted link, a damaged ``latest``) into ``quarantine/``, with the reason."""
    where = storage.move_aside(path, layout.quarantine, f"{path.name}.{int(time.time())}")
    is_dir = storage.kind(where) == "dir"
    note = quarantine_note(where, is_dir)
    record: dict[str, object] = {"path": str(path), "reason": reason, "step": step}
    shared = _linked_files(where) if is_dir else {}
    if shared:  # pieces of an incremental save: their bytes are other steps' too, and stay theirs
        record["shared"] = {"files": sorted(shared), "bytes": sum(shared.values())}
    storage.write_atomic(note, json_bytes(record))
    log.error("QUARANTINED %s: %s -> %s", path, reason, where)
    return where


def _linked_files(step_dir: Path) -> dict[str, int]:
    """Files of ``step_dir`` whose bytes another name holds too (hard links of shared pieces), with sizes."""
    out: dict[str, int] = {}
    try:
        entries = list(os.scandir(step_dir))
    except OSError:
        return out
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if entry.is_file(follow_symlinks=False) and st.st_nlink > 1:
            out[entry.name] = st.st_size
    return out


def _newest_verifying(storage: Storage, layout: CheckpointLayout) -> tuple[int, str] | None:
    """The newest published step whose files verify against its manifest and markers: (step, manifest hash)."""
    for step, path in reversed(step_entries(storage, layout.checkpoints)):
        try:
            verify_committed(path, step)
        except VerificationError as e:
            log.warning("committed step %d does not verify, not a candidate for latest: %s", step, e)
            continue
        return step, hash_file(path / MANIFEST)
    return None


def recheck_latest(storage: Storage, layout: CheckpointLayout) -> list[str]:
    """Re-verify the step ``latest`` names; on damage quarantine it and point ``latest`` at the newest step
    that verifies (or remove ``latest`` if none does). Returns what was repaired."""
    repairs: list[str] = []
    for path in planted(storage, layout):
        kind = storage.kind(path)
        where = quarantine(storage, layout, path, f"{path} is a {kind}, not a step directory; never followed")
        repairs.append(f"{path} was a {storage.kind(where)}, not a step directory (moved to {where})")
    try:
        latest = read_latest(layout)
        if latest is None:
            return repairs
        verify_committed(layout.committed_step(latest.step), latest.step)
        return repairs
    except VerificationError as e:
        problem = str(e)
    damaged = latest_step_name(layout)
    step_damaged = damaged is not None and storage.kind(layout.committed_step(damaged)) is not None
    if damaged is not None and step_damaged:
        where = quarantine(storage, layout, layout.committed_step(damaged), problem, damaged)
    else:
        where = quarantine(storage, layout, layout.latest, problem)
    fallback = _newest_verifying(storage, layout)
    if fallback is None:
        storage.delete_file(layout.latest)
        now = "latest removed (no committed step verifies)"
    else:
        write_latest(layout, *fallback)
        now = f"latest moved back to step {fallback[0]}" if step_damaged else f"latest rebuilt as step {fallback[0]}"
        now += ", the newest step that verifies"
    repairs.append(f"{now}: {problem} (moved to {where}); rerun to train again from there")
    return repairs


def latest_step_name(layout: CheckpointLayout) -> int | None:
    """The step a (possibly damaged) ``latest`` names, if it names one; used only to decide what to quarantine."""
    try:
        obj = read_record_json(layout.latest, "latest pointer")
    except (OSError, VerificationError):
        return None
    step = obj.get("step") if isinstance(obj, dict) else None
    return step if type(step) is int and step >= 0 and obj.get("dir") == step_name(step) else None
