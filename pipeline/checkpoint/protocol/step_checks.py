"""What the committer checks of one staged step before it publishes it, on every store: the markers agree (one
world size, one attempt, one known format, no file claimed twice), each marker lists only its rank's files,
every listed file has its recorded size and hash, and the format's own metadata names no unlisted file.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pipeline.checkpoint.manifest import Manifest, Marker, marker_path, step_markers
from pipeline.errors import CheckpointFormatError, ReadFailed, VerificationError, plural
from pipeline.formats.registry import FORMATS, Format
from pipeline.storage.integrity import FileEntry, verify_entries


def check_agreement(step: int, markers: list[Marker], where: str) -> tuple[Format, tuple[FileEntry, ...]]:
    """The markers of one step agree (one world size, as many markers, one attempt, one known format) and no
    file is claimed twice: the step's format and every file the markers list."""
    world = {m.world_size for m in markers}
    attempts = {m.attempt for m in markers}
    if len(world) != 1 or len(markers) not in world or len(attempts) != 1:
        raise VerificationError(
            f"markers of step {step} in {where} disagree: {len(markers)} markers, world sizes {sorted(world)}, "
            f"attempts {sorted(attempts)}"
        )
    formats = {m.format for m in markers}
    if len(formats) != 1 or not formats <= FORMATS.keys():
        raise VerificationError(
            f"markers of step {step} in {where} name format(s) {sorted(formats)}; known: {sorted(FORMATS)}"
        )
    files = tuple(f for m in markers for f in m.files)
    dupes = sorted(p for p, n in Counter(f.path for f in files).items() if n > 1)
    if dupes:
        raise VerificationError(
            f"markers of step {step} in {where} claim the same file(s) {dupes}: files are rank-private"
        )
    return FORMATS[markers[0].format], files


def check_stored(fmt: Format, step_dir: Path, step: int, markers: list[Marker], allow_pickle: bool) -> None:
    """The format's own metadata (verified bytes by now) names every file holding data, and how many ranks wrote
    them (read once: a DCP step's ranks follow from its file names): all listed, by the markers' world size."""
    paths = {f.path for m in markers for f in m.files}
    try:
        stored = fmt.stored_files(step_dir, allow_pickle)
    except CheckpointFormatError as e:  # its bytes matched the marker's hash: the rank wrote it so, or it vanished
        raise VerificationError(f"step {step} in {step_dir}: its {fmt.name} metadata was refused: {e}") from e
    unlisted = sorted(stored - paths)
    if unlisted:
        raise VerificationError(
            f"step {step} in {step_dir}: {unlisted} hold checkpoint data but no marker lists them (a marker that "
            "lists fewer files than its rank wrote)"
        )
    written_by = fmt.world_size_of(step_dir, stored, allow_pickle)
    if written_by != markers[0].world_size:
        raise VerificationError(
            f"step {step} in {step_dir}: the {fmt.name} files were written by {plural(written_by, 'rank')}, the "
            f"markers say {markers[0].world_size}"
        )


def foreign_files(markers: list[Marker], fmt: Format) -> tuple[Marker, list[str]] | None:
    """The first marker that lists a file its format names as another rank's, with those files."""
    for m in markers:
        foreign = [f.path for f in m.files if fmt.owner(f.path) not in (None, m.rank)]
        if foreign:
            return m, foreign
    return None


def verify_marked(staged: Path, markers: list[Marker], fmt: Format) -> None:
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
                f"{marker_path(staged, m.rank)} lists {foreign}, which {fmt.name} names as another rank's "
                "files: each rank lists only the files it owns"
            )
        entries.extend(m.files)
        listed_in.extend([str(marker_path(staged, m.rank))] * len(m.files))
    verify_entries(staged, entries, listed_in)


def verified_manifest(step: int, markers: list[Marker], step_dir: Path, run_id: str, allow_pickle: bool) -> Manifest:
    """Every check of this module on ``step_dir``, then the manifest that commits it: a function of the markers
    (one attempt) alone, so whichever committer writes it writes the same bytes."""
    fmt, files = check_agreement(step, markers, str(step_dir))
    verify_marked(step_dir, markers, fmt)
    check_stored(fmt, step_dir, step, markers, allow_pickle)
    first = markers[0]
    return Manifest(
        step=step,
        world_size=first.world_size,
        format=first.format,
        attempt=first.attempt,
        run_id=run_id,
        files=files,
        metrics=dict(first.metrics),
    )


def not_as_verified(moved: Path, manifest: Manifest) -> str:
    """Why the staged dir just moved to ``moved`` is not what ``manifest`` was verified from ("" when it is:
    every rank's marker there, of the verified attempt, listing the same files). A ghost that verified attempt
    a1 and froze may rename a dir the ranks have since filled (or are filling) with a2; no rank writes a file of
    a new attempt before removing its old marker, so the same markers after the rename mean the same files.
    A dir moved that fails this stays a step without a manifest, which no reader counts and the next pass
    verifies for what it holds."""
    try:
        markers = step_markers(moved, manifest.step, manifest.world_size)
    except (VerificationError, ReadFailed) as e:
        return f"the markers moved to {moved} cannot be checked against attempt {manifest.attempt} ({e})"
    files = tuple(f for m in markers if m is not None for f in m.files)
    if any(m is None or m.attempt != manifest.attempt for m in markers) or files != manifest.files:
        got, found = sorted({m.attempt for m in markers if m is not None}), sum(m is not None for m in markers)
        return (
            f"the staged dir moved to {moved} is not attempt {manifest.attempt} as verified (it holds markers of "
            f"{got or 'no attempt'}, {found} of {manifest.world_size}: saved again since?)"
        )
    return ""
