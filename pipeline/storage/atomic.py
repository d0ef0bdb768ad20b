"""The one place that publishes files and directories.

Two ways to publish, as in Orbax's ``atomicity`` module:

* a **file** is written to ``<name>.tmp-<pid>`` in the same directory, flushed, fsynced, renamed onto its
  final name, and the directory is fsynced (:func:`write_bytes_atomic`, :func:`write_json_atomic`);
* a **directory** is filled in a staging location, its files fsynced, and then renamed into place in one
  ``rename`` followed by an fsync of both parents (:func:`publish_dir`).

A file that must never replace an existing one (a run's lease) is created whole or not at all by
:func:`create_exclusive` (``link`` from a fsynced temp file).

An fsync or close error fails the write: it is never retried into "success". No other module renames or
deletes shared paths; stages call these helpers.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def json_bytes(obj: Any) -> bytes:
    """The one JSON encoding of files this pipeline writes (sorted keys, indented, newline-terminated)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, json_bytes(obj))


def create_exclusive(path: Path, data: bytes, mode: int = 0o644) -> bool:
    """Create ``path`` holding all of ``data``; return False, changing nothing, if ``path`` already exists.

    The data is written and fsynced under a unique temp name, then hard-linked onto ``path``: ``link`` fails
    if the name exists, atomically on local filesystems and NFS alike, so of two creators exactly one wins and
    no reader sees a partial file. On NFS a retransmitted ``link`` can report failure after it succeeded, so
    the temp file's link count decides (as in open(2)'s advice on lock files). The temp name is always removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except OSError as e:
            if os.stat(tmp).st_nlink != 2:
                if isinstance(e, FileExistsError):
                    return False
                raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def read_json(path: Path) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (bottom-up), so a later rename publishes durable data."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def publish_dir(staged: Path, final: Path) -> None:
    """Atomically move a fully written directory into place. ``final`` must not exist."""
    if final.exists():
        raise PipelineError(
            f"cannot publish {staged} to {final}: the destination already exists; "
            "a published directory is never overwritten (rerun with force to redo the stage)"
        )
    fsync_tree(staged)
    os.rename(staged, final)
    fsync_dir(final.parent)
    if staged.parent != final.parent:
        fsync_dir(staged.parent)


def move_aside(path: Path, dest_dir: Path, name: str) -> Path:
    """Rename ``path`` into ``dest_dir/name`` (quarantine, retired outputs); never deletes."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / name
    n = 1
    while dest.exists():
        dest = dest_dir / f"{name}.{n}"
        n += 1
    os.rename(path, dest)
    fsync_dir(dest_dir)
    fsync_dir(path.parent)
    return dest


def remove_tree(path: Path) -> None:
    """Delete a directory tree (only the one owner of ``path`` may call this, e.g. prepare-dirs on overwrite).

    The tree is first renamed to a hidden sibling, so a crash mid-delete never leaves a half-deleted
    directory under the original name.
    """
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.deleting-{os.getpid()}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash)


def clear_file(path: Path) -> None:
    """Remove a rank-private or owner-private file if present (e.g. a stale done-marker before a re-save)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_dir(path.parent)
