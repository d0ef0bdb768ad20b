"""Per-rank done-markers, the step manifest and the ``latest`` pointer: the on-disk commit protocol.

* ``staging/step_N/rank_<K>.done.json`` — written last and atomically by rank K: step, rank, world size,
  format, attempt, and each of its files (relative path, size, xxh3-128).
* ``step_N/manifest.json`` — written by verify-manifest after every file was checked; readers trust it, never
  a directory listing.
* ``checkpoints/latest`` — JSON naming the newest committed step and its manifest hash; replaced atomically
  only after the step directory is published.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.atomic import read_json, write_json_atomic
from pipeline.errors import VerificationError
from pipeline.integrity import FileEntry, hash_file, safe_join
from pipeline.layout import RunLayout, step_name

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def marker_path(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank_{rank}.done.json"


@dataclass(frozen=True)
class Marker:
    step: int
    rank: int
    world_size: int
    format: str
    attempt: str
    files: tuple[FileEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "format": self.format,
            "attempt": self.attempt,
            "files": [f.to_json() for f in self.files],
        }

    @staticmethod
    def from_json(obj: Any, where: str) -> Marker:
        try:
            return Marker(
                step=int(obj["step"]),
                rank=int(obj["rank"]),
                world_size=int(obj["world_size"]),
                format=str(obj["format"]),
                attempt=str(obj["attempt"]),
                files=tuple(FileEntry.from_json(f, where) for f in obj["files"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise VerificationError(f"malformed marker {where}: {e}") from e


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


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    format: str
    attempt: str
    run_id: str
    files: tuple[FileEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "format": self.format,
            "attempt": self.attempt,
            "run_id": self.run_id,
            "files": [f.to_json() for f in self.files],
        }

    @staticmethod
    def from_json(obj: Any, where: str) -> Manifest:
        try:
            return Manifest(
                step=int(obj["step"]),
                world_size=int(obj["world_size"]),
                format=str(obj["format"]),
                attempt=str(obj["attempt"]),
                run_id=str(obj["run_id"]),
                files=tuple(FileEntry.from_json(f, where) for f in obj["files"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise VerificationError(f"malformed manifest {where}: {e}") from e


def write_manifest(step_dir: Path, manifest: Manifest) -> str:
    path = step_dir / MANIFEST
    write_json_atomic(path, manifest.to_json())
    return hash_file(path)


def read_manifest(step_dir: Path) -> Manifest:
    path = step_dir / MANIFEST
    if not path.exists():
        raise VerificationError(f"{path} is missing: {step_dir} is not a committed step")
    return Manifest.from_json(read_json(path), str(path))


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
