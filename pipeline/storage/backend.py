"""The storage seam: the few primitives the checkpoint protocol needs from a store, and their POSIX implementation.

The protocol (rank-private writes, markers, one verifying committer, ``latest`` moved last) asks a store for:

* ``write_atomic``: a whole file or nothing under its final name (POSIX: temp file, fsync, rename, fsync dir);
* ``create_exclusive``: the same, but only if the name does not exist yet (POSIX: ``link``; S3: ``If-None-Match``);
* ``publish``: make a finished step visible in one indivisible act (POSIX: rename of a durable directory; on a
  store without rename the manifest written exclusively is that act);
* ``kind`` / ``list``: what a name is (never following a link) and which names an area holds (listings only
  nominate; markers and manifests decide);
* ``open_read``: read a file's bytes;
* ``move_aside`` / ``delete_file`` / ``delete_tree``: quarantine (never delete) and retention;
* ``exclusive``: the one-committer lock (POSIX: ``flock``, released when its holder dies).

Code above the seam (the committer, the :class:`~pipeline.checkpoint.Checkpointer`) calls these through a
:class:`Storage` object; :class:`PosixStorage` is today's one implementation, over :mod:`pipeline.storage.atomic`
and :mod:`pipeline.storage.integrity` (the only modules that rename, link or ``lstat``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from pipeline.storage import atomic
from pipeline.storage.integrity import lstat_kind


class Storage(Protocol):
    """What the checkpoint protocol needs from a store (paths are ``Path``s; an object store maps them to keys)."""

    def write_atomic(self, path: Path, data: bytes) -> None: ...
    def create_exclusive(self, path: Path, data: bytes) -> bool: ...
    def publish(self, staged: Path, final: Path) -> None: ...
    def kind(self, path: Path) -> str | None: ...
    def list(self, path: Path) -> list[str]: ...
    def open_read(self, path: Path) -> BinaryIO: ...
    def makedirs(self, path: Path) -> None: ...
    def move_aside(self, path: Path, dest_dir: Path, name: str) -> Path: ...
    def delete_file(self, path: Path) -> None: ...
    def delete_tree(self, path: Path) -> None: ...
    def exclusive(self, path: Path) -> contextlib.AbstractContextManager[bool]: ...


class PosixStorage:
    """A local or shared POSIX filesystem (NFS, Lustre, GPFS): every mutation through :mod:`atomic`."""

    def write_atomic(self, path: Path, data: bytes) -> None:
        atomic.write_bytes_atomic(path, data)

    def create_exclusive(self, path: Path, data: bytes) -> bool:
        return atomic.create_exclusive(path, data)

    def publish(self, staged: Path, final: Path) -> None:
        atomic.publish_dir(staged, final)

    def kind(self, path: Path) -> str | None:
        return lstat_kind(path)

    def list(self, path: Path) -> list[str]:
        if lstat_kind(path) != "dir":
            return []
        return sorted(os.listdir(path))

    def open_read(self, path: Path) -> BinaryIO:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return os.fdopen(fd, "rb")

    def makedirs(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)  # idempotent mkdir of a planned directory

    def move_aside(self, path: Path, dest_dir: Path, name: str) -> Path:
        return atomic.move_aside(path, dest_dir, name)

    def delete_file(self, path: Path) -> None:
        atomic.clear_file(path)

    def delete_tree(self, path: Path) -> None:
        atomic.remove_tree(path)

    @contextlib.contextmanager
    def exclusive(self, path: Path) -> Iterator[bool]:
        """Hold ``flock(LOCK_EX)`` on ``path`` (created if needed, never deleted) for the block; yields False,
        without waiting, when another process holds it. The kernel releases it when its holder dies."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing the only descriptor releases the lock


def held_elsewhere(path: Path) -> bool:
    """Whether another process holds the ``flock`` on ``path`` now (a committer is alive), without taking it
    for longer than the probe."""
    if lstat_kind(path) != "file":
        return False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


POSIX = PosixStorage()
"""The default store."""
