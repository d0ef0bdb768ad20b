"""File digests and safe relative paths: what markers, manifests and stage records are made of."""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import xxhash

from pipeline.errors import UnsafePathError, VerificationError

HASH_ALGO = "xxh3_128"
_CHUNK = 8 << 20
MAX_RECORD_BYTES = 64 << 20
"""Largest marker, manifest, ``latest`` or output marker this pipeline reads (a million-file manifest fits)."""


def lstat_kind(path: Path) -> str | None:
    """What ``path`` itself is, never following a link: ``dir``, ``file``, ``symlink``, ``other`` or None."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            return None  # a name no file of this pipeline can have
        raise
    if stat.S_ISLNK(mode):
        return "symlink"
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def is_real_dir(path: Path) -> bool:
    """A directory, not a symlink to one: how every managed area of a run dir is checked."""
    return lstat_kind(path) == "dir"


def not_real_dirs(paths: list[Path]) -> list[str]:
    """Why each of ``paths`` that should be a real directory is not (missing, a file, or a symlink)."""
    return [f"{p} is {lstat_kind(p) or 'missing'}" for p in paths if not is_real_dir(p)]


def read_record_json(path: Path, what: str) -> Any:
    """Parse a small JSON record (marker, manifest, ``latest``, output marker) that may have been tampered with.

    Never follows a symlink, never blocks on a FIFO, refuses anything but a regular file of at most
    :data:`MAX_RECORD_BYTES`; every failure is a :class:`VerificationError` naming ``path``.
    FileNotFoundError passes through (callers decide what absence means).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise VerificationError(f"{what} {path} is a symlink, which is never followed: remove it") from None
        if isinstance(e, FileNotFoundError):
            raise
        raise VerificationError(f"cannot read {what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise VerificationError(f"{what} {path} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_RECORD_BYTES + 1)
    if len(raw) > MAX_RECORD_BYTES:
        raise VerificationError(f"{what} {path} is larger than {MAX_RECORD_BYTES} bytes: not one this pipeline wrote")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        detail = str(e).replace("\n", " ")[:200]
        raise VerificationError(f"{what} {path} is not valid JSON ({detail})") from None


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
    def from_json(obj: object, where: str) -> FileEntry:
        path, size, digest = (obj.get(k) for k in ("path", "size", "hash")) if isinstance(obj, dict) else (None,) * 3
        if not (isinstance(path, str) and type(size) is int and size >= 0 and isinstance(digest, str)):
            shown = repr(obj)[:200]
            raise VerificationError(
                f"malformed file entry {shown} in {where}: needs path (str), size (int >= 0) and hash (str)"
            )
        return FileEntry(path=path, size=size, hash=digest)


def describe(root: Path, rel: str) -> FileEntry:
    full = safe_join(root, rel)
    return FileEntry(path=rel, size=full.stat().st_size, hash=hash_file(full))


def safe_join(root: Path, rel: str) -> Path:
    """Join a path read from a manifest or marker onto ``root``; refuse anything that could escape it.

    Relative, normalised, no ``..``, no absolute paths, and no symlink anywhere from ``root`` (itself included)
    down to the file: every existing component is checked with ``lstat``, never followed.
    """
    pure = PurePosixPath(rel)
    too_long = len(rel.encode(errors="replace")) >= 4096 or any(
        len(p.encode(errors="replace")) > 255 for p in pure.parts
    )
    control = any(ord(c) < 32 for c in rel)
    if not rel or pure.is_absolute() or ".." in pure.parts or rel != str(pure) or "\\" in rel or control or too_long:
        raise UnsafePathError(
            f"unsafe path {rel[:200]!r} under {root}: paths in markers and manifests must be relative, normalised, "
            "without control characters, and no longer than the filesystem allows"
        )
    full = root
    for part in (None, *pure.parts):
        full = full if part is None else full / part
        if lstat_kind(full) == "symlink":
            raise UnsafePathError(f"{full} is a symlink: nothing under a run's managed areas is ever followed")
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
            st = os.lstat(full)
        except FileNotFoundError:
            raise VerificationError(f"{full} is listed in {where} but missing") from None
        except NotADirectoryError:
            raise VerificationError(f"{full} is listed in {where}, but a parent of it is not a directory") from None
        if not stat.S_ISREG(st.st_mode):
            raise VerificationError(f"{full} is listed in {where} but is not a regular file")
        size = st.st_size
        if size != e.size:
            raise VerificationError(f"{full}: size {size} != {e.size} recorded in {where}")
        got = hash_file(full)
        if got != e.hash:
            differs = f"{HASH_ALGO} {got[:12]}.. != {e.hash[:12]}.."
            raise VerificationError(f"{full}: content differs from {where} ({differs})")
