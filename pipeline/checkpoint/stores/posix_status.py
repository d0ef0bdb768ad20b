"""``python -m pipeline.status`` for checkpoints in a directory: committed steps (each manifest read; a listing
only nominates), ``latest`` checked against its manifest's hash, staged steps with how many markers each has,
quarantine entries with their notes, and the retention record."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pipeline.checkpoint.manifest import MANIFEST, MARKER_RE, read_latest, read_manifest
from pipeline.checkpoint.protocol.retention import record_path
from pipeline.checkpoint.stores.bucket_status import add_sharing
from pipeline.checkpoint.stores.repair import QUARANTINE_NOTE, quarantine_note
from pipeline.errors import PipelineError
from pipeline.formats.dcp_names import is_piece
from pipeline.storage.integrity import FileEntry, lstat_kind, read_record_json
from pipeline.storage.layout import CheckpointLayout, parse_step

Status = dict[str, Any]


def why(e: BaseException) -> str:
    """An error as one line (its type when it has no message)."""
    return " ".join(str(e).split()) or type(e).__name__


def read_json(path: Path, what: str) -> tuple[Any, str | None]:
    """(content, None), (None, None) when absent, or (None, why it cannot be read)."""
    try:
        return read_record_json(path, what), None
    except FileNotFoundError:
        return None, None
    except (PipelineError, OSError) as e:
        return None, why(e)


def _committed(layout: CheckpointLayout, latest_step: int | None) -> list[Status]:
    out = []
    for name, step in step_entries(layout.checkpoints):
        entry: Status = {"step": step, "latest": step == latest_step}
        step_dir = layout.checkpoints / name
        if lstat_kind(step_dir) == "dir" and lstat_kind(step_dir / MANIFEST) is None:
            entry["error"] = (
                "not committed yet: moved into place, its manifest not written (a commit interrupted between its "
                "two acts); the committer's next pass verifies it and writes the manifest"
            )
            out.append(entry)
            continue
        try:
            manifest = read_manifest(step_dir)
        except (PipelineError, OSError) as e:
            entry["error"] = why(e)
        else:
            entry["files"] = len(manifest.files)
            entry["bytes"] = sum(f.size for f in manifest.files)
            entry["format"] = manifest.format
            entry["world_size"] = manifest.world_size
            entry["pieces"] = local_pieces(layout.checkpoints / name, manifest.files)
            if manifest.metrics:
                entry["metrics"] = manifest.metrics
        out.append(entry)
    return out


def step_entries(area: Path) -> list[tuple[str, int]]:
    """``step_N`` names of ``area`` with their steps, oldest first (none when it is not a real directory)."""
    try:
        names = [p.name for p in area.iterdir()] if lstat_kind(area) == "dir" else []
    except OSError:
        names = []
    return sorted(((n, s) for n in names if (s := parse_step(n)) is not None), key=lambda e: e[1])


def _staged(layout: CheckpointLayout, world_size: int | None) -> list[Status]:
    out = []
    for name, step in step_entries(layout.staging):
        path = layout.staging / name
        entry: Status = {"step": step, "world_size": world_size}
        try:
            if lstat_kind(path) != "dir":
                raise OSError(f"{path} is a {lstat_kind(path)}, not a directory")
            entry["markers"] = sum(1 for p in path.iterdir() if MARKER_RE.match(p.name))
        except OSError as e:
            entry["error"] = why(e)
        out.append(entry)
    return out


def _quarantined(layout: CheckpointLayout) -> list[Status]:
    try:
        names = sorted(p.name for p in layout.quarantine.iterdir()) if lstat_kind(layout.quarantine) == "dir" else []
    except OSError:
        names = []
    out = []
    for name in (n for n in names if not n.endswith(f".{QUARANTINE_NOTE}")):
        path = layout.quarantine / name
        note = quarantine_note(path, lstat_kind(path) == "dir")
        rec, problem = read_json(note, "quarantine note")
        entry: Status = {"name": name, "path": str(path)}
        stamp = name.rsplit(".", 1)[-1]
        if stamp.isdigit():
            entry["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(stamp)))
        if isinstance(rec, dict):
            entry.update(step=rec.get("step"), reason=str(rec.get("reason")), source=rec.get("path"))
            shared = rec.get("shared")
            if isinstance(shared, dict) and isinstance(shared.get("files"), list):
                entry["reason"] += (
                    f" [{len(shared['files'])} shared piece(s), {shared.get('bytes')} bytes: hard links whose "
                    "bytes committed steps keep]"
                )
        else:
            entry["error"] = problem or ("no quarantine note" if rec is None else "quarantine note is not an object")
        out.append(entry)
    return out


def describe(layout: CheckpointLayout, world_size: int | None) -> Status:
    """The checkpoints of ``layout``'s directory, as ``status`` shows them."""
    latest: Status | None = None
    latest_error = None
    if lstat_kind(layout.latest) is not None:
        try:
            found = read_latest(layout)
            latest = {"step": found.step, "manifest_hash": found.manifest_hash} if found else None
        except (PipelineError, OSError) as e:
            latest_error = why(e)
    retention, retention_error = read_json(record_path(layout), "retention record")
    committed = _committed(layout, latest["step"] if latest else None)
    return {
        "latest": latest,
        "latest_error": latest_error,
        "committed": committed,
        "shared_saved": add_sharing(committed),
        "staged": _staged(layout, world_size),
        "quarantined": _quarantined(layout),
        "retention": retention,
        "retention_error": retention_error,
    }


def local_pieces(step_dir: Path, files: tuple[FileEntry, ...]) -> dict[Any, int]:
    """A committed step's pieces on POSIX by inode (linked files are one), never following a link."""
    out: dict[Any, int] = {}
    for e in files:
        if is_piece(e.path):
            try:
                st = os.lstat(step_dir / e.path)
            except OSError:
                continue
            out[(st.st_dev, st.st_ino)] = e.size
    return out
