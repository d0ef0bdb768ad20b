"""Per-rank done-markers, the step manifest and the ``latest`` pointer: the on-disk commit protocol.

* ``staging/step_N/rank_<K>.done.json`` — written last and atomically by rank K: step, rank, world size,
  format, attempt, and each of its files (relative path, size, xxh3-128); optionally the ``metrics`` training
  reported with the step (name -> number, ``null`` for a value that was not finite).
* ``step_N/manifest.json`` — written by verify-manifest after every file was checked; readers trust it, never
  a directory listing. It carries rank 0's ``metrics`` (what best-k retention ranks by), checked against rank 0's
  marker like the rest. Metrics are advisory: nothing but the rank that wrote them vouches for a marker's values,
  and at worst they change which older steps best-k retention keeps (never ``latest``, never what is loaded).
* ``checkpoints/latest`` — JSON naming the newest committed step and its manifest hash; replaced atomically
  only after the step directory is published.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import VerificationError, plural
from pipeline.storage.atomic import json_bytes, write_bytes_atomic, write_json_atomic
from pipeline.storage.integrity import (
    FileEntry,
    hash_file,
    is_real_dir,
    lstat_kind,
    read_record_json,
    safe_join,
    verify_entries,
)
from pipeline.storage.layout import CheckpointLayout, parse_step, step_name

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


MARKER_RE = re.compile(r"^rank_(\d+)\.done\.json$")
"""A done-marker's name (rank K's is ``rank_K.done.json``)."""


def marker_path(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank_{rank}.done.json"


R = TypeVar("R", bound="_FileRecord")
Metrics = dict[str, float | None]
"""What training reported with a step: metric name -> value (``None``: not finite, e.g. a NaN loss)."""


def is_metrics(value: Any) -> bool:
    """A JSON metrics object: string keys, each value a number (not a bool) or null."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and (v is None or (isinstance(v, int | float) and not isinstance(v, bool)))
        for k, v in value.items()
    )


_TYPES: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: type(v) is int and v >= 0,
    "str": lambda v: isinstance(v, str),
    "Metrics": is_metrics,
}
_OPTIONAL = frozenset({"metrics"})
"""Fields a record may omit (written only when not empty, so older records read as they were)."""


@dataclass(frozen=True)
class _FileRecord:
    """Shared JSON form of markers and manifests: scalar fields + ``files`` + ``format_version``."""

    files: tuple[FileEntry, ...]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "files"}
        for name in _OPTIONAL & out.keys():
            if not out[name]:
                del out[name]
        out["files"] = [e.to_json() for e in self.files]
        out["format_version"] = FORMAT_VERSION
        return out

    @classmethod
    def from_json(cls: type[R], obj: Any, where: str) -> R:
        """Parse strictly: every field present with its exact JSON type (ints >= 0), or a VerificationError."""
        what = cls.__name__.lower()
        if not isinstance(obj, dict) or not isinstance(obj.get("files"), list):
            raise VerificationError(f"malformed {what} {where}: not an object with a 'files' list")
        version = obj.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:  # JSON true == 1 in Python: exact type
            raise VerificationError(
                f"{what} {where} has format_version {obj.get('format_version')!r}; this pipeline reads {FORMAT_VERSION}"
            )
        given = [f for f in fields(cls) if f.name != "files" and (f.name not in _OPTIONAL or f.name in obj)]
        scalars = {f.name: obj.get(f.name) for f in given}
        bad = [f.name for f in given if not _TYPES[str(f.type)](obj.get(f.name))]
        if bad:
            raise VerificationError(f"malformed {what} {where}: missing or wrong type: {', '.join(bad)}")
        return cls(files=tuple(FileEntry.from_json(e, where) for e in obj["files"]), **scalars)


@dataclass(frozen=True, kw_only=True)
class Marker(_FileRecord):
    """``rank_<K>.done.json``: what one rank wrote for one step, written last."""

    step: int
    rank: int
    world_size: int
    format: str
    attempt: str
    metrics: Metrics = field(default_factory=dict)
    """What training passed with the step (``save(step, state, metrics=...)``); the committer keeps rank 0's."""


def write_marker(step_dir: Path, marker: Marker) -> None:
    """A rank's last write into its staged step: the committer may publish the step before the write's closing
    ``fsync`` of the directory, which is then no failure of the rank's."""
    write_json_atomic(marker_path(step_dir, marker.rank), marker.to_json(), parent_may_move=True)


def read_marker(step_dir: Path, rank: int) -> Marker | None:
    path = marker_path(step_dir, rank)
    try:
        obj = read_record_json(path, "marker")
    except FileNotFoundError:
        return None
    return Marker.from_json(obj, str(path))


def staged_world(step_dir: Path, step: int, default: int) -> int:
    """How many markers a staged step needs: the world size its rank-0 marker records (a step staged before the
    run went on at another world size, or an imported one), else ``default`` (the run's world size). A marker
    that under-counts cannot slip a rank past the commit: the format's own files name every rank that wrote."""
    try:
        first = read_marker(step_dir, 0)
    except VerificationError:
        return default
    return first.world_size if first is not None and first.step == step and first.world_size >= 1 else default


def step_markers(step_dir: Path, step: int, world_size: int) -> list[Marker | None]:
    """Each rank's marker of ``step`` (None where absent); a marker naming another rank or step is refused."""
    if not is_real_dir(step_dir):
        raise VerificationError(f"{step_dir} is not a directory (a symlink is never followed)")
    out: list[Marker | None] = []
    for rank in range(world_size):
        m = read_marker(step_dir, rank)
        if m is not None and (m.rank != rank or m.step != step):
            raise VerificationError(
                f"{marker_path(step_dir, rank)} claims rank {m.rank} of step {m.step}: "
                f"a marker must name its own rank ({rank}) and step ({step})"
            )
        if m is not None and m.world_size != world_size:
            raise VerificationError(
                f"{marker_path(step_dir, rank)} was written by a world of {plural(m.world_size, 'rank')}; "
                f"this run has {world_size} (strategy.world_size)"
            )
        out.append(m)
    return out


def complete_markers(markers: list[Marker | None], attempt: str | None) -> list[Marker] | None:
    """The one marker rule, shared by train's "already staged" and the committer: every rank's marker is there
    and all come from one attempt of train — ``attempt`` when the producing train is running (its own save is
    the one to wait for), any single attempt once no train runs (a finished or failed attempt's complete save
    is a valid checkpoint; markers mixing attempts never are). None when the step is not complete.
    """
    present = [m for m in markers if m is not None]
    if len(present) != len(markers) or not present:
        return None
    attempts = {m.attempt for m in present}
    if len(attempts) != 1 or (attempt is not None and attempts != {attempt}):
        return None
    return present


def describe_incomplete(markers: list[Marker | None], attempt: str | None) -> str:
    """Why :func:`complete_markers` said no: the ranks without a marker, or the attempts the markers mix."""
    missing = [str(r) for r, m in enumerate(markers) if m is None]
    if missing:
        return f"rank(s) {', '.join(missing)} wrote no done-marker"
    by_attempt: dict[str, list[int]] = {}
    for r, m in enumerate(markers):
        if m is not None:
            by_attempt.setdefault(m.attempt, []).append(r)
    wanted = f" (waiting for attempt {attempt})" if attempt is not None else ""
    parts = [f"rank(s) {', '.join(map(str, rs))} from attempt {a}" for a, rs in sorted(by_attempt.items())]
    return f"markers come from different attempts of train: {'; '.join(parts)}{wanted}"


@dataclass(frozen=True, kw_only=True)
class Manifest(_FileRecord):
    """``step_N/manifest.json``: every file of a committed step, checked before publishing."""

    step: int
    world_size: int
    format: str
    attempt: str
    run_id: str
    metrics: Metrics = field(default_factory=dict)
    """Rank 0's marker's metrics: what best-k retention ranks the step by, and what ``status`` shows."""


def write_manifest(step_dir: Path, manifest: Manifest) -> str:
    """Commit ``step_dir`` by its manifest (temp, fsync, rename); its hash. The manifest is a function of the
    staged attempt, so two committers write the same bytes. Two mounts of one shared filesystem renaming onto
    one name at the same instant can lose one temp file (seen on SeaweedFS's FUSE mount): the other's rename
    landed, and the bytes there are this one's. (Not ``link`` onto the name: that mount shows another mount's
    hard link with its first name removed as a file that cannot be opened.)"""
    path = step_dir / MANIFEST
    data = json_bytes(manifest.to_json())
    try:
        write_bytes_atomic(path, data)
    except FileNotFoundError:
        try:
            landed = path.read_bytes() == data
        except OSError:
            landed = False
        if not landed:
            raise
        log.info("%s was written by another committer at the same instant: the same bytes", path)
    return hash_file(path)


def read_manifest(step_dir: Path) -> Manifest:
    path = step_dir / MANIFEST
    kind = lstat_kind(step_dir)
    if kind != "dir":
        what = "missing" if kind is None else f"a {kind}, not a directory (a symlink is never followed)"
        raise VerificationError(f"{step_dir} is {what}: not a committed step")
    try:
        obj = read_record_json(path, "manifest")
    except FileNotFoundError:
        raise VerificationError(f"{path} is missing: {step_dir} is not a committed step") from None
    return Manifest.from_json(obj, str(path))


def verify_committed(step_dir: Path, step: int | None = None) -> Manifest:
    """Check every file of a committed step against its manifest (size, then hash); return the manifest.

    ``step`` (when given) must be the step the manifest records: a step directory cannot pass for another.
    """
    manifest = read_manifest(step_dir)
    if step is not None and manifest.step != step:
        raise VerificationError(f"{step_dir / MANIFEST} records step {manifest.step}, not {step}")
    markers = step_markers(step_dir, manifest.step, manifest.world_size)  # published with the step
    present = complete_markers(markers, None)
    if present is None:
        raise VerificationError(f"{step_dir}: {describe_incomplete(markers, None)}; its manifest cannot be checked")
    said = (tuple(f for m in present for f in m.files), present[0].attempt, present[0].format, present[0].metrics)
    if said != (manifest.files, manifest.attempt, manifest.format, manifest.metrics):
        raise VerificationError(
            f"{step_dir / MANIFEST} does not say what the step's markers say (files, attempt, format or metrics): "
            "an entry was dropped, added or changed"
        )
    verify_entries(step_dir, list(manifest.files), str(step_dir / MANIFEST))
    return manifest


@dataclass(frozen=True)
class Latest:
    step: int
    manifest_hash: str


def parse_pointer(obj: object) -> Latest | None:
    """A ``latest`` record as written (``{"step", "dir", "manifest_hash"[, "epoch"]}``; the epoch of the committer
    that moved it is optional: older pointers lack it), or None when it is malformed. Both stores read it so."""
    if not isinstance(obj, dict):
        return None
    step, digest, epoch = obj.get("step"), obj.get("manifest_hash"), obj.get("epoch", 0)
    if type(step) is not int or step < 0 or not isinstance(digest, str) or obj.get("dir") != step_name(step):
        return None
    if type(epoch) is not int or epoch < 0:
        return None
    return Latest(step=step, manifest_hash=digest)


def read_latest(layout: CheckpointLayout) -> Latest | None:
    """The newest committed step, checked: its directory exists and its manifest hash matches.

    Every malformation (not JSON, wrong fields, a symlink, a step dir that is a link) is a VerificationError;
    the committer (verify_manifest) repairs ``latest`` from the newest step that verifies.
    """
    try:
        obj = read_record_json(layout.latest, "latest pointer")
    except FileNotFoundError:
        return None
    pointer = parse_pointer(obj)
    if pointer is None:
        raise VerificationError(
            f"{layout.latest} is malformed ({repr(obj)[:120]}): it must name step, dir and manifest_hash; "
            "rerun verify_manifest to rebuild it from the newest step that verifies"
        )
    step, digest = pointer.step, pointer.manifest_hash
    manifest_file = safe_join(layout.checkpoints, f"{step_name(step)}/{MANIFEST}")
    try:
        same = lstat_kind(manifest_file) == "file" and hash_file(manifest_file) == digest
    except FileNotFoundError:  # retired between the look and the read
        same = False
    if not same:
        raise VerificationError(f"{layout.latest} names step {step}, but {manifest_file} is missing or differs")
    return Latest(step=step, manifest_hash=digest)


def pointer_step(layout: CheckpointLayout) -> int:
    """The step the ``latest`` pointer itself names, checked (0: none)."""
    latest = read_latest(layout)
    return latest.step if latest else 0


def read_newest(layout: CheckpointLayout) -> Latest | None:
    """What a reader resumes from: the newest committed step. A step's manifest is its commit (written only once
    every file verified); ``latest`` is the committer's pointer to it, and a reader takes a newer published step
    over it (``latest`` lags when a commit was interrupted before moving it, or a stale committer moved it late)
    and any published step over a well-formed ``latest`` that names no usable step (a step retired, quarantined
    or committed again since): ``latest`` never regresses for a reader, and no stale write to it can stop one. A
    ``latest`` that is no pointer at all (garbage, a link) is refused: no committer writes one. The
    committer's own check of ``latest`` is :func:`read_latest`. Every file of the step returned is still to be
    verified by the caller."""
    try:
        latest = read_latest(layout)
    except VerificationError:
        named = _named_step(layout)
        if named is None:
            raise  # not a pointer at all (garbage, a link): no committer wrote it; the committer repairs it loudly
        newest = _newest_published(layout, -1)  # a pointer behind newer steps, or to a step gone: not damage;
        if newest is not None and newest.step >= named:  # or to a step committed again since (a ghost's late
            return newest  # pointer names the old copy): as its manifest records it, verified by the caller
        if lstat_kind(layout.committed_step(named)) is not None:
            raise  # its step is there with another manifest: damage until the committer says otherwise
        if _retired(layout, named):
            raise VerificationError(
                f"{layout.latest} names step {named}, which a late retention moved to {layout.checkpoints / TRASH}: "
                "the committer brings it back on its next pass; resume again then"
            ) from None
        return newest
    return _newest_published(layout, latest.step if latest is not None else -1) or latest


TRASH = ".deleting"
"""Where retention moves a committed step before deleting it (:mod:`pipeline.checkpoint.protocol.trash`)."""


def _named_step(layout: CheckpointLayout) -> int | None:
    try:
        obj = read_record_json(layout.latest, "latest pointer")
    except (OSError, VerificationError):
        return None
    pointer = parse_pointer(obj)
    return pointer.step if pointer is not None else None


def _retired(layout: CheckpointLayout, step: int) -> bool:
    """Whether a retired copy of ``step`` waits in the trash (a late retention's, which the committer undoes)."""
    trash = layout.checkpoints / TRASH
    try:
        return is_real_dir(trash) and any(n.startswith(f"{step_name(step)}.e") for n in os.listdir(trash))
    except OSError:
        return False


def _newest_published(layout: CheckpointLayout, after: int) -> Latest | None:
    """The newest published step above ``after`` whose manifest records it."""
    names = os.listdir(layout.checkpoints) if is_real_dir(layout.checkpoints) else []
    for step in sorted((s for s in map(parse_step, names) if s is not None and s > after), reverse=True):
        manifest_file = layout.committed_step(step) / MANIFEST
        if not is_real_dir(manifest_file.parent) or lstat_kind(manifest_file) != "file":
            continue
        try:
            if read_manifest(manifest_file.parent).step == step:
                return Latest(step=step, manifest_hash=hash_file(manifest_file))
        except (VerificationError, FileNotFoundError):  # damaged, or retired while read
            continue
    return None


def write_latest(
    layout: CheckpointLayout, step: int, manifest_hash: str, epoch: int | None = None, copy_of: str | None = None
) -> None:
    """Replace ``latest``; ``epoch``: the committer lease epoch of the writer (who moved it, for readers);
    ``copy_of``: the bucket pointer this local one is a pulled copy of (said in the record, with when)."""
    record: dict[str, object] = {"step": step, "dir": step_name(step), "manifest_hash": manifest_hash}
    if epoch is not None:
        record["epoch"] = epoch
    if copy_of is not None:
        record["copy_of"] = copy_of
        record["pulled_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record["note"] = "a local copy of one step pulled from the bucket; the bucket's latest may be newer"
    write_json_atomic(layout.latest, record)
