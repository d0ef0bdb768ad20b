"""The POSIX store's repairs (:mod:`pipeline.checkpoint.stores.posix_store`): its litter, planted entries, and damage
that several steps share. The decisions (re-verify ``latest``, fall back to the newest step that verifies) are the
committer's, written once for every store.

* :func:`sweep_temp_files`: temp files a committer that died left in ``checkpoints/``;
* :func:`planted`: ``step_N`` entries that are links or files (quarantined, never followed);
* :func:`quarantine_damage`: a damaged step moves to ``quarantine/`` together with every committed step that
  holds one of its damaged files (a piece of an incremental save hard-linked into several steps: one inode, so
  one damage), each note naming the piece (the committer then moves ``latest`` back if its step went);
* :func:`quarantine`: a path moved aside with the reason beside it;
* :func:`move_back`: a step a late quarantine moved by mistake (not the copy found bad) goes back, or stays in
  ``quarantine/`` with a note saying it is not damaged.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.checkpoint.manifest import (
    MANIFEST,
    MARKER_RE,
    Marker,
    complete_markers,
    read_manifest,
    staged_world,
    step_markers,
    verify_committed,
    write_manifest,
)
from pipeline.checkpoint.protocol.step_checks import verified_manifest
from pipeline.errors import PipelineError, ReadFailed, VerificationError
from pipeline.storage.atomic import clear_file, is_temp_name, json_bytes
from pipeline.storage.backend import Storage
from pipeline.storage.integrity import (
    MAX_RECORD_BYTES,
    FileEntry,
    lstat_kind,
    read_record_json,
    safe_join,
    verify_entries,
)
from pipeline.storage.layout import CheckpointLayout, parse_step, step_name

log = logging.getLogger(__name__)

QUARANTINE_NOTE = "quarantine.json"
"""Why an entry was quarantined: inside a quarantined directory, or beside anything else as ``<name>.<NOTE>``."""


def quarantine_note(where: Path, is_dir: bool) -> Path:
    """Where the reason of the quarantined ``where`` is written (read by ``status``)."""
    return where / QUARANTINE_NOTE if is_dir else where.with_name(f"{where.name}.{QUARANTINE_NOTE}")


def step_entries(storage: Storage, area: Path) -> list[tuple[int, Path]]:
    """``step_N`` entries of ``area`` (the listing only nominates; markers and manifests decide)."""
    steps = ((parse_step(name), name) for name in storage.list(area))
    return sorted((s, area / name) for s, name in steps if s is not None)


# -- repairs -----------------------------------------------------------------------------------------------


def sweep_temp_files(storage: Storage, layout: CheckpointLayout) -> None:
    """Temp files a committer that died left in ``checkpoints/`` (e.g. ``latest.tmp-*``): its own litter."""
    sweep_temp_files_in(storage, layout.checkpoints)


def sweep_temp_files_in(storage: Storage, where: Path) -> None:
    """Temp files directly in ``where`` (a committer's own litter there: never content)."""
    for name in storage.list(where):
        path = where / name
        if is_temp_name(name) and storage.kind(path) == "file":
            log.info("removing %s, left by a commit that did not finish", path)
            storage.delete_file(path)


def planted(storage: Storage, layout: CheckpointLayout) -> list[Path]:
    """``step_N`` entries of ``checkpoints/`` or ``staging/`` that are not real directories (links, files)."""
    areas = (layout.checkpoints, layout.staging)
    return [p for area in areas for _, p in step_entries(storage, area) if storage.kind(p) != "dir"]


def quarantine(
    storage: Storage,
    layout: CheckpointLayout,
    path: Path,
    reason: str,
    step: int | None = None,
    damaged: dict[str, object] | None = None,
) -> Path:
    """Move ``path`` (a step dir, a planted link, a damaged ``latest``) into ``quarantine/``, with the reason.
    ``damaged``: the damaged shared piece that took it there (its file, where it was found, why, with which steps)."""
    where = storage.move_aside(path, layout.quarantine, f"{path.name}.{int(time.time())}")
    is_dir = storage.kind(where) == "dir"
    note = quarantine_note(where, is_dir)
    record: dict[str, object] = {"path": str(path), "reason": reason, "step": step}
    shared = _linked_files(where) if is_dir else {}
    if shared or damaged:  # pieces of an incremental save: their bytes are other steps' too, and stay theirs
        pieces: dict[str, object] = {"files": sorted(shared), "bytes": sum(shared.values())}
        if damaged:
            pieces["damaged"] = damaged
        record["shared"] = pieces
    storage.write_atomic(note, json_bytes(record))
    log.error("QUARANTINED %s: %s -> %s", path, reason, where)
    return where


MOVE_BACK_TRIES = 3
"""How often :func:`move_back` tries the rename while the step's path is free (a transient I/O error)."""


def move_back(storage: Storage, where: Path, path: Path, step: int, why: str) -> bool:
    """Put the step directory ``where``, which a late quarantine moved there by mistake (``why``: how it is known
    not to be the copy found bad), back at ``path``; returns whether it went back.

    If it cannot (``path`` was taken meanwhile: another copy of the step committed there since; or the rename
    keeps failing), the copy is never lost silently: it stays in ``quarantine/`` with a note that says it is not
    damaged and whether it verifies against its own manifest (``status`` shows it in one line), and the log says
    so. It is not moved anywhere else: ``checkpoints/step_N`` is the one copy readers and retention see, and a
    second copy of the step beside it would be a step of its own to both; the user keeps or deletes it by hand."""
    note = quarantine_note(where, True)
    problem = ""
    for attempt in range(MOVE_BACK_TRIES):
        if storage.kind(path) is not None:
            problem = f"{path} was taken meanwhile (another copy of step {step} is there now)"
            break
        try:
            clear_file(note)
            storage.publish(where, path)
        except (OSError, PipelineError) as e:
            problem = f"it could not be moved back to {path} ({e})"
            time.sleep(0.2 * (attempt + 1))
            continue
        log.warning("step %d moved back from %s: %s", step, where, why)
        return True
    try:
        verify_committed(where, step)
        verdict = "it verifies against its own manifest"
    except (OSError, PipelineError) as e:
        verdict = f"it was not verified here ({' '.join(str(e).split())[:200]})"
    reason = (
        f"NOT DAMAGED: a good copy of step {step} ({why}), moved here by a late quarantine after the step was "
        f"committed again; {problem}, so it stays here; {verdict}"
    )
    try:
        storage.write_atomic(note, json_bytes({"path": str(path), "reason": reason, "step": step, "good": True}))
    except (OSError, PipelineError) as e:
        log.error("cannot write %s: %s", note, e)
    log.error("step %d: %s stays in quarantine: %s", step, where, reason)
    return False


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


# -- damage shared by several steps (the pieces of incremental saves) ----------------------------------------


def quarantine_damage(
    storage: Storage, layout: CheckpointLayout, path: Path, problem: str, step: int | None
) -> tuple[Path, dict[int, str]]:
    """Quarantine the step at ``path`` (committed or staged) that failed verification with ``problem``, and with
    it every committed step holding one of its damaged files under the same inode (a hard-linked piece: the
    same bytes, the same damage), each note naming the piece. Returns where ``path`` went and, per other step
    quarantined, a line saying why."""
    bad = damaged_links(path)  # before the move: the names are the step's
    where = quarantine(storage, layout, path, problem, step, _damage_note(bad, path, problem) if bad else None)
    lines: dict[int, str] = {}
    wanted = {ident: entry for ident, entry in bad.values()}
    for other, (other_path, held) in holders(storage, layout, set(wanted), path).items():
        names = sorted(name for name, ident in held if _holds_damage(other_path, name, wanted[ident]))
        if not names:
            continue
        why = f"{', '.join(names)}: one file (hard link) with the damaged one(s) of {path}: {problem}"
        moved = quarantine(storage, layout, other_path, why, other, _damage_note(bad, path, problem))
        lines[other] = f"step {other}: holds {', '.join(names)}, damaged in {path} too (moved to {moved})"
    return where, lines


def _damage_note(bad: dict[str, tuple[tuple[int, int], FileEntry]], path: Path, problem: str) -> dict[str, object]:
    return {"files": sorted(bad), "found_in": str(path), "reason": problem}


def _holds_damage(step_dir: Path, name: str, bad: FileEntry) -> bool:
    """Whether ``step_dir``'s ``name`` (one inode with a file that does not match ``bad``) fails what
    ``step_dir`` itself lists for it: at once when it lists the same size and hash, else re-hashed. A file the
    step does not list, or a step whose list cannot be read, is left to its own verification."""
    mine = next((e for e in _listed(step_dir) if e.path == name), None)
    if mine is None:
        return False
    if (mine.size, mine.hash) == (bad.size, bad.hash):
        return True
    try:
        verify_entries(step_dir, [mine], str(step_dir))
    except VerificationError:  # a read that fails is unknown, not damage: it takes no other step along
        return True
    return False


def _listed(step_dir: Path) -> list[FileEntry]:
    """The files a step lists: its manifest's (committed), else its readable markers' (staged); unreadable: none."""
    try:
        if lstat_kind(step_dir / MANIFEST) == "file":
            return list(read_manifest(step_dir).files)
        names = [e.name for e in os.scandir(step_dir) if MARKER_RE.match(e.name) and e.is_file(follow_symlinks=False)]
    except (OSError, VerificationError):
        return []
    out: list[FileEntry] = []
    for name in names:
        try:
            out += Marker.from_json(read_record_json(step_dir / name, "marker"), str(step_dir / name)).files
        except (OSError, VerificationError):
            continue
    return out


def damaged_links(step_dir: Path) -> dict[str, tuple[tuple[int, int], FileEntry]]:
    """The files of ``step_dir`` that another name holds too (a hard link: several steps' piece) and that do not
    match what the step lists for them: name -> ((st_dev, st_ino), entry). Only those are re-hashed, one by one;
    nothing is followed through a symlink."""
    out: dict[str, tuple[tuple[int, int], FileEntry]] = {}
    for e in _listed(step_dir):
        try:
            st = os.lstat(safe_join(step_dir, e.path))
        except (OSError, VerificationError):
            continue  # missing or unsafe: this step's own damage, no other step's
        if not stat.S_ISREG(st.st_mode) or st.st_nlink < 2:
            continue
        try:
            verify_entries(step_dir, [e], str(step_dir))
        except VerificationError:  # bytes read whole that differ; a failed read (ReadFailed) is no evidence
            out[e.path] = ((st.st_dev, st.st_ino), e)
    return out


def holders(
    storage: Storage, layout: CheckpointLayout, idents: set[tuple[int, int]], besides: Path
) -> dict[int, tuple[Path, list[tuple[str, tuple[int, int]]]]]:
    """Committed steps other than ``besides`` with files of those inodes (lstat only, never followed):
    step -> (the step dir, [(the file's name, its inode)])."""
    out: dict[int, tuple[Path, list[tuple[str, tuple[int, int]]]]] = {}
    if not idents:
        return out
    inodes = {ino for _, ino in idents}
    for step, path in step_entries(storage, layout.checkpoints):
        if path == besides or storage.kind(path) != "dir":
            continue
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.inode() not in inodes or not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in idents:
                out.setdefault(step, (path, []))[1].append((entry.name, (st.st_dev, st.st_ino)))
    return out


def read_or_none(path: Path) -> bytes | None:
    """``path``'s bytes (a record's size at most), or None when it cannot be opened now (never through a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_RECORD_BYTES)


def _latest_record(layout: CheckpointLayout) -> dict[str, object]:
    """``latest`` as a record ({} when absent, or not one); a read that fails raises (ReadFailed)."""
    try:
        obj = read_record_json(layout.latest, "latest pointer")
    except (OSError, VerificationError):
        return {}
    return obj if isinstance(obj, dict) else {}


def latest_step_name(layout: CheckpointLayout) -> int | None:
    """The step a (possibly damaged) ``latest`` names, if it names one; used only to decide what to quarantine."""
    obj = _latest_record(layout)
    step = obj.get("step")
    return step if type(step) is int and step >= 0 and obj.get("dir") == step_name(step) else None


def committed_attempt(layout: CheckpointLayout, step: int) -> str | None:
    """The attempt committed ``step``'s manifest records (None: not committed; "": a manifest past reading)."""
    try:
        return read_manifest(layout.committed_step(step)).attempt
    except FileNotFoundError:
        return None
    except VerificationError:
        return ""


def latest_epoch(layout: CheckpointLayout) -> int | None:
    """The lease epoch of the committer that wrote ``latest`` (None: unknown, or no ``latest``)."""
    epoch = _latest_record(layout).get("epoch")
    return epoch if type(epoch) is int else None


def unmanifested(storage: Storage, layout: CheckpointLayout) -> list[tuple[int, Path]]:
    """Step dirs of ``checkpoints/`` without their manifest: moved into place, not committed (yet)."""
    kind = storage.kind
    return [
        (s, p) for s, p in step_entries(storage, layout.checkpoints) if kind(p) == "dir" and kind(p / MANIFEST) is None
    ]


def finishing(storage: Storage, layout: CheckpointLayout, world_size: int) -> list[int]:
    """The :func:`unmanifested` steps holding every rank's marker: what :func:`finish_unmanifested` finishes once
    they verify (a reader that resumes waits for them)."""
    found = []
    for step, path in unmanifested(storage, layout):
        try:
            if complete_markers(step_markers(path, step, staged_world(path, step, world_size)), None) is not None:
                found.append(step)
        except (VerificationError, OSError):
            continue
    return found


def finish_unmanifested(
    storage: Storage, layout: CheckpointLayout, fence: Callable[[], None], world_size: int, allow_pickle: bool
) -> None:
    """A step moved into place without its manifest: a commit interrupted between its rename and its manifest
    (or two committers' publishes raced on a FUSE mount). Verified, its manifest is written (after the temp file
    a manifest write that died left there)."""
    for step, path in unmanifested(storage, layout):
        try:
            markers = complete_markers(step_markers(path, step, staged_world(path, step, world_size)), None)
            if markers is None:
                continue
            manifest = verified_manifest(step, markers, path, layout.run_id, allow_pickle)
        except (VerificationError, OSError, ReadFailed) as e:
            log.warning("%s is published without a manifest and does not verify (or cannot be read now); not a "
                        "committed step: %s", path, e)  # fmt: skip
            continue
        fence()
        sweep_temp_files_in(storage, path)
        write_manifest(path, manifest)
        log.warning("step %d was moved into place without its manifest (a commit interrupted, or raced): verified, "
                    "manifest written", step)  # fmt: skip
