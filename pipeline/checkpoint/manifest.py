"""Per-rank done-markers, the step manifest and the ``latest`` pointer: the on-disk commit protocol.

* ``staging/step_N/rank_<K>.done.json`` — written last and atomically by rank K: step, rank, world size,
  format, attempt, and each of its files (relative path, size, xxh3-128).
* ``step_N/manifest.json`` — written by verify-manifest after every file was checked; readers trust it, never
  a directory listing.
* ``checkpoints/latest`` — JSON naming the newest committed step and its manifest hash; replaced atomically
  only after the step directory is published.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import VerificationError
from pipeline.storage.atomic import read_json, write_json_atomic
from pipeline.storage.integrity import FileEntry, hash_file, safe_join, verify_entries
from pipeline.storage.layout import RunLayout, step_name

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def marker_path(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank_{rank}.done.json"


R = TypeVar("R", bound="_FileRecord")
_CASTS: dict[str, Callable[[Any], Any]] = {"int": int, "str": str}


@dataclass(frozen=True)
class _FileRecord:
    """Shared JSON form of markers and manifests: scalar fields + ``files`` + ``format_version``."""

    files: tuple[FileEntry, ...]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "files"}
        out["files"] = [e.to_json() for e in self.files]
        out["format_version"] = FORMAT_VERSION
        return out

    @classmethod
    def from_json(cls: type[R], obj: Any, where: str) -> R:
        try:
            scalars = {f.name: _CASTS[str(f.type)](obj[f.name]) for f in fields(cls) if f.name != "files"}
            return cls(files=tuple(FileEntry.from_json(e, where) for e in obj["files"]), **scalars)
        except (KeyError, TypeError, ValueError) as e:
            raise VerificationError(f"malformed {cls.__name__.lower()} {where}: {e}") from e


@dataclass(frozen=True, kw_only=True)
class Marker(_FileRecord):
    """``rank_<K>.done.json``: what one rank wrote for one step, written last."""

    step: int
    rank: int
    world_size: int
    format: str
    attempt: str


def write_marker(step_dir: Path, marker: Marker) -> None:
    write_json_atomic(marker_path(step_dir, marker.rank), marker.to_json())


def read_marker(step_dir: Path, rank: int) -> Marker | None:
    path = marker_path(step_dir, rank)
    if not path.exists():
        return None
    try:
        obj = read_json(path)
    except ValueError as e:
        raise VerificationError(f"marker {path} is not valid JSON: {e}") from e
    return Marker.from_json(obj, str(path))


@dataclass(frozen=True, kw_only=True)
class Manifest(_FileRecord):
    """``step_N/manifest.json``: every file of a committed step, checked before publishing."""

    step: int
    world_size: int
    format: str
    attempt: str
    run_id: str


def write_manifest(step_dir: Path, manifest: Manifest) -> str:
    path = step_dir / MANIFEST
    write_json_atomic(path, manifest.to_json())
    return hash_file(path)


def read_manifest(step_dir: Path) -> Manifest:
    path = step_dir / MANIFEST
    if not path.exists():
        raise VerificationError(f"{path} is missing: {step_dir} is not a committed step")
    return Manifest.from_json(read_json(path), str(path))


def verify_committed(step_dir: Path) -> Manifest:
    """Check every file of a committed step against its manifest (size, then hash); return the manifest."""
    manifest = read_manifest(step_dir)
    verify_entries(step_dir, list(manifest.files), str(step_dir / MANIFEST))
    return manifest


@dataclass(frozen=True)
class Latest:
    step: int
    manifest_hash: str


def read_latest(layout: RunLayout) -> Latest | None:
    """The newest committed step, checked: its directory exists and its manifest hash matches."""
    if not layout.latest.exists():
        return None
    obj = read_json(layout.latest)
    try:
        latest = Latest(step=int(obj["step"]), manifest_hash=str(obj["manifest_hash"]))
        if obj["dir"] != step_name(latest.step):
            raise ValueError(f"dir {obj['dir']!r} does not match step {latest.step}")
    except (KeyError, TypeError, ValueError) as e:
        raise VerificationError(
            f"{layout.latest} is malformed ({e}); restore it from the newest step_*/manifest.json"
        ) from e
    manifest_file = safe_join(layout.checkpoints, step_name(latest.step)) / MANIFEST
    if not manifest_file.exists() or hash_file(manifest_file) != latest.manifest_hash:
        raise VerificationError(f"{layout.latest} names step {latest.step}, but {manifest_file} is missing or differs")
    return latest


def write_latest(layout: RunLayout, step: int, manifest_hash: str) -> None:
    write_json_atomic(layout.latest, {"step": step, "dir": step_name(step), "manifest_hash": manifest_hash})
