"""File digests and safe relative paths: what markers, manifests and stage records are made of."""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from pipeline.errors import UnsafePathError, VerificationError
from pipeline.storage import reads
from pipeline.storage.settle import parse_settled

HASH_ALGO = "xxh3_128"
_CHUNK = 8 << 20
VERIFY_READERS = 4
"""Files :func:`verify_entries` hashes at once. One reader leaves a disk idle while it hashes and waits on one
request at a time; a few keep its queue full (xxh3 releases the GIL on large buffers, and so does ``readinto``),
so verifying runs at the speed of a cold read of the same files (``bench/verify_speed.py``)."""
_buffers = threading.local()
MAX_RECORD_BYTES = 64 << 20
"""Largest marker, manifest, ``latest`` or output marker this pipeline reads (a million-file manifest fits)."""


def lstat_kind(path: Path | str) -> str | None:
    """What ``path`` itself is, never following a link: ``dir``, ``file``, ``symlink``, ``other`` or None."""
    try:
        try:
            mode = os.lstat(path).st_mode
        except OSError as e:
            if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
                return None  # a name no file of this pipeline can have
            if not reads.is_transient(e):
                raise
            mode = reads.lstat(path).st_mode  # the storage did not answer: again, then ReadFailed
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(mode):
        return "symlink"
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def mtimes_ns(paths: Sequence[Path]) -> tuple[int, ...]:
    """Each path's own modification time in ns (never through a link; -1 when missing): a cheap stamp of what
    a set of directories held, since every publish, commit, record and removal renames or unlinks in one."""
    out = []
    for path in paths:
        try:
            out.append(os.lstat(path).st_mtime_ns)
        except (FileNotFoundError, NotADirectoryError):
            out.append(-1)
    return tuple(out)


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
    FileNotFoundError passes through (callers decide what absence means). A record that does not parse is read
    again briefly first: another node may be replacing it (see :mod:`pipeline.storage.settle`).
    """
    return parse_settled(lambda: _read_record(path, what), lambda raw: _parse_record(raw, path, what), (_Torn,))


class _Torn(VerificationError):
    """Not JSON: damaged, or a replace seen half-way through a shared mount (read again before believing it)."""


def _read_record(path: Path, what: str) -> bytes:
    """The record's bytes, read whole: a read that fails or comes back short is retried, then :class:`ReadFailed`
    (unknown, never damage: :mod:`pipeline.storage.reads`)."""
    return reads.retrying(lambda: _read_record_once(path, what), what, path)


def _read_record_once(path: Path, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise VerificationError(f"{what} {path} is a symlink, which is never followed: remove it") from None
        raise
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise VerificationError(f"{what} {path} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_RECORD_BYTES + 1)
    if len(raw) > MAX_RECORD_BYTES:
        raise VerificationError(f"{what} {path} is larger than {MAX_RECORD_BYTES} bytes: not one this pipeline wrote")
    if len(raw) < st.st_size:  # a short read: the storage did not give the bytes it has, nothing said of them
        raise OSError(errno.EIO, f"short read ({len(raw)} of {st.st_size} bytes)", str(path))
    return raw


def _parse_record(raw: bytes, path: Path, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        detail = str(e).replace("\n", " ")[:200]
        raise _Torn(f"{what} {path} is not valid JSON ({detail})") from None


def hash_file(path: Path) -> str:
    """xxh3-128 of a file, read in 8 MiB chunks (xxh3 runs far above disk speed; see performance-baselines).

    The chunk buffer is allocated once per thread (zeroing 8 MiB costs more than reading a small file), and the
    kernel is told the file is read sequentially (a larger readahead window). A read that fails is read again
    from the start, then :class:`~pipeline.errors.ReadFailed` (:func:`pipeline.storage.reads.retrying`): never
    a digest of part of the file. ``FileNotFoundError`` passes through.
    """
    return reads.retrying(functools.partial(_hash_once, path), "file", path)


def _hash_once(path: Path) -> str:
    h = xxhash.xxh3_128()
    buf = _chunk_buffer()
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        _advise_sequential(f.fileno())
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _chunk_buffer() -> bytearray:
    buf: bytearray | None = getattr(_buffers, "chunk", None)
    if buf is None:
        buf = _buffers.chunk = bytearray(_CHUNK)
    return buf


def _advise_sequential(fd: int) -> None:
    advise = getattr(os, "posix_fadvise", None)  # not on macOS
    if advise is not None:
        with contextlib.suppress(OSError):  # a pipe or a filesystem that takes no advice: only a hint
            advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


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
    return SafeRoot(root).join(rel)


class SafeRoot:
    """:func:`safe_join` for many paths under one ``root`` (a marker's or a manifest's files, a DCP metadata's
    data files): the same checks, but each directory on the way is checked once per :class:`SafeRoot` rather
    than once per file, so checking N files costs O(N), not O(N x depth) ``lstat`` calls.

    Nothing is resolved: a path whose every component from ``root`` down is no symlink (each checked with
    ``lstat``) and that has no ``..`` cannot leave ``root``, wherever ``root`` itself lies (a link above it is the
    user's choice of where the run lives). Paths are handled as strings inside (pathlib costs more than the
    ``lstat`` calls at tens of thousands of files).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root = os.fspath(root)
        # How str(root / "a/b") spells a path under root: "." adds nothing, "/" adds no second slash.
        self._base = "" if self._root == "." else self._root if self._root.endswith("/") else self._root + "/"
        self._real_dirs: set[str] = set()  # components already seen to be real directories, not symlinks

    def join(self, rel: str) -> Path:
        parts = _checked_parts(rel, self.root)
        full = self._root
        for i in range(len(parts) + 1):  # root itself, then every component down to the file
            if i:
                full = self._base + parts[0] if i == 1 else full + "/" + parts[i - 1]
            if full in self._real_dirs:
                continue
            kind = lstat_kind(full)
            if kind == "symlink":
                raise UnsafePathError(f"{full} is a symlink: nothing under a run's managed areas is ever followed")
            if kind == "dir":
                self._real_dirs.add(full)
        return Path(full)


def _checked_parts(rel: str, root: Path) -> list[str]:
    """``rel``'s components, once it is seen to be relative, normalised, free of ``..``, backslashes and control
    characters, and within the filesystem's name limits (else :class:`UnsafePathError` naming it and ``root``)."""
    parts = rel.split("/")
    if (
        not rel
        or len(rel.encode(errors="replace")) >= 4096
        or "\\" in rel
        or any(ord(c) < 32 for c in rel)
        or any(p in ("", ".", "..") or len(p.encode(errors="replace")) > 255 for p in parts)
    ):
        raise UnsafePathError(
            f"unsafe path {rel[:200]!r} under {root}: paths in markers and manifests must be relative, "
            "normalised, without control characters, and no longer than the filesystem allows"
        )
    return parts


def verify_entries(root: Path, entries: Sequence[FileEntry], where: str | Sequence[str]) -> None:
    """Check each entry's size, then hash; raise naming the first file that does not match.

    ``where`` names the list in the errors (a marker, a manifest): one name for every entry, or one per entry
    (several markers' lists checked together). Every entry's path, type and size are checked first, in order;
    the files before the first that fails there are then hashed by up to :data:`VERIFY_READERS` threads at once.
    The error raised is the one a file-by-file pass would raise: that of the earliest entry that fails.
    """
    wheres = [where] * len(entries) if isinstance(where, str) else list(where)
    if len(wheres) != len(entries):
        raise ValueError(f"verify_entries: {len(entries)} entries but {len(wheres)} names of where they are listed")
    fulls: list[Path] = []
    failed: Exception | None = None
    under = SafeRoot(root)
    for e, listed_in in zip(entries, wheres, strict=True):
        try:
            fulls.append(_checked_size(under, e, listed_in))
        except Exception as exc:  # raised after the files listed before it are hashed: list order decides
            failed = exc
            break
    batches = _batches(entries, fulls)
    readers = min(VERIFY_READERS, len(batches))
    if readers <= 1:
        _compare(entries, wheres, fulls, itertools.chain.from_iterable(map(_hash_batch, batches)))
    else:
        with ThreadPoolExecutor(readers, thread_name_prefix="verify-read") as pool:
            try:
                _compare(entries, wheres, fulls, itertools.chain.from_iterable(pool.map(_hash_batch, batches)))
            finally:
                pool.shutdown(wait=True, cancel_futures=True)  # a mismatch: the files after it are not read
    if failed is not None:
        raise failed


_BATCH_FILES = 64
"""Small files are hashed in runs of up to this many (or ``_CHUNK`` bytes) per task: one task per 2 KB file would
cost more in thread hand-offs than the reads."""


def _batches(entries: Sequence[FileEntry], fulls: list[Path]) -> list[list[Path]]:
    """``fulls`` in list order, cut into runs of at most ``_BATCH_FILES`` files or about ``_CHUNK`` bytes."""
    out: list[list[Path]] = []
    run: list[Path] = []
    size = 0
    for e, full in zip(entries, fulls, strict=False):
        run.append(full)
        size += e.size
        if size >= _CHUNK or len(run) >= _BATCH_FILES:
            out.append(run)
            run, size = [], 0
    if run:
        out.append(run)
    return out


def _hash_batch(paths: list[Path]) -> list[str | Exception]:
    """Each file's digest, in order; a file that cannot be read ends the run with its error (raised in order)."""
    out: list[str | Exception] = []
    for path in paths:
        try:  # looked up when called: a test's patched ``hash_file`` sees every file
            out.append(hash_file(path))
        except FileNotFoundError:
            out.append(_missing_now(path))
            break
        except Exception as exc:
            out.append(exc)
            break
    return out


def _missing_now(path: Path) -> Exception:
    """A listed file gone between its size check and its read: absent (damage) only once that has settled."""
    if reads.settled_absent(path):
        return VerificationError(f"{path} is listed but vanished while it was verified")
    return reads.failed(OSError(errno.EIO, "it vanished and came back while it was read"), "file", path)


def _compare(
    entries: Sequence[FileEntry], wheres: list[str], fulls: list[Path], hashes: Iterator[str | Exception]
) -> None:
    for e, listed_in, full, got in zip(entries, wheres, fulls, hashes, strict=False):
        if isinstance(got, Exception):
            raise got
        if got != e.hash:
            differs = f"{HASH_ALGO} {got[:12]}.. != {e.hash[:12]}.."
            raise VerificationError(f"{full}: content differs from {listed_in} ({differs})")


def _checked_size(root: SafeRoot, e: FileEntry, where: str) -> Path:
    """``root/e.path`` if it is a regular file (reached without a symlink) of the size ``where`` records."""
    full = root.join(e.path)
    try:
        st = reads.lstat(full)
    except FileNotFoundError:
        if not reads.settled_absent(full):  # another node's rename not seen here yet: look again
            return _checked_size(root, e, where)
        raise VerificationError(f"{full} is listed in {where} but missing") from None
    except NotADirectoryError:
        raise VerificationError(f"{full} is listed in {where}, but a parent of it is not a directory") from None
    if not stat.S_ISREG(st.st_mode):
        raise VerificationError(f"{full} is listed in {where} but is not a regular file")
    size = st.st_size
    if size != e.size:
        raise VerificationError(f"{full}: size {size} != {e.size} recorded in {where}")
    return full
