"""File digests and safe relative paths: what markers, manifests and stage records are made of."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import xxhash

from pipeline.errors import UnsafePathError, VerificationError

HASH_ALGO = "xxh3_128"
_CHUNK = 8 << 20


def hash_file(path: Path) -> str:
    """xxh3-128 of a file, read in 8 MiB chunks (xxh3 runs far above disk speed; see performance-baselines)."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, relative to the directory that holds it."""

    path: str
    size: int
    hash: str

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, "hash": self.hash}

    @staticmethod
    def from_json(obj: dict[str, object], where: str) -> FileEntry:
        try:
            return FileEntry(path=str(obj["path"]), size=int(obj["size"]), hash=str(obj["hash"]))  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError) as e:
            raise VerificationError(f"malformed file entry {obj!r} in {where}: {e}") from e


def describe(root: Path, rel: str) -> FileEntry:
    full = safe_join(root, rel)
    return FileEntry(path=rel, size=full.stat().st_size, hash=hash_file(full))


def safe_join(root: Path, rel: str) -> Path:
    """Join a path read from a manifest or marker onto ``root``; refuse anything that could escape it.

    Relative, normalised, no ``..``, no absolute paths, and no symlink on the way out of ``root``.
    """
    pure = PurePosixPath(rel)
    if not rel or pure.is_absolute() or ".." in pure.parts or rel != str(pure) or "\\" in rel:
        raise UnsafePathError(
            f"unsafe path {rel!r} under {root}: paths in markers and manifests must be relative and normalised"
        )
    full = root.joinpath(*pure.parts)
    resolved_root = root.resolve()
    resolved = full.resolve()
    if resolved != resolved_root and resolved_root not in resolved.parents:
        raise UnsafePathError(f"path {rel!r} under {root} resolves to {resolved}, outside the directory (symlink?)")
    return full


def verify_entries(root: Path, entries: list[FileEntry], where: str) -> None:
    """Check each entry's size, then hash; raise naming the first file that does not match."""
    for e in entries:
        full = safe_join(root, e.path)
        try:
            size = os.stat(full).st_size
        except FileNotFoundError:
            raise VerificationError(f"{full} is listed in {where} but missing") from None
        if size != e.size:
            raise VerificationError(f"{full}: size {size} != {e.size} recorded in {where}")
        got = hash_file(full)
        if got != e.hash:
            raise VerificationError(f"{full}: {HASH_ALGO} {got} != {e.hash} recorded in {where}")
