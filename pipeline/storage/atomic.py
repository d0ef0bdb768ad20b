"""The one place that publishes files and directories.

Two ways to publish, as in Orbax's ``atomicity`` module:

* a **file** is written to ``<name>.tmp-<pid>-<token>`` in the same directory, flushed, fsynced, renamed onto
  its final name, and the directory is fsynced (:func:`write_bytes_atomic`, :func:`write_json_atomic`);
* a **directory** is filled in a staging location, its files fsynced, and then renamed into place in one
  ``rename`` followed by an fsync of both parents (:func:`publish_dir`).

A file that must never replace an existing one (a run's lease) is created whole or not at all by
:func:`create_exclusive` (``link`` from a fsynced temp file).

An fsync or close error fails the write: it is never retried into "success". No other module renames or
deletes shared paths; stages call these helpers. Every mutation here is announced to
:func:`pipeline.storage.faults.io_op` first, so crash tests can stop the "process" before any one of them.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError, UnsafePathError
from pipeline.storage.faults import io_op
from pipeline.storage.settle import parse_settled

_TEMP_NAME = re.compile(r"\.tmp-\d+-[0-9a-f]{8}$")
"""Names :func:`write_bytes_atomic` writes before its rename: never content, whoever left them."""


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    io_op("fsync_dir", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    io_op("fsync", path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    # pid + random token: no two writers (threads, or a crashed attempt that reused a pid) share a temp file.
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    """True for the temp names of :func:`write_bytes_atomic` (litter when a writer died before its rename)."""
    return _TEMP_NAME.search(name) is not None


def _write_new(tmp: Path, data: bytes, mode: int, sync: bool = True) -> None:
    """Create ``tmp`` (it must not exist), write all of ``data`` and fsync it (``sync``). A created file that
    fails is left for the caller to remove."""
    io_op("create", tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            io_op("write", tmp)
            view = view[os.write(fd, view) :]
        if sync:
            io_op("fsync", tmp)
            os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(
    path: Path, data: bytes, mode: int = 0o644, *, parent_may_move: bool = False, sync: bool = True
) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part.

    ``parent_may_move``: the write is the last a directory receives before another process may move it (a rank's
    done-marker: the committer then publishes the step). The rename has landed; a directory gone by the closing
    ``fsync`` of it was moved by that process, which makes the tree it moves durable (``publish_dir``).
    ``sync=False``: no fsync of the file or its dir (a process that dies still leaves the whole file or none;
    a machine that crashes may leave a torn one: only for files whose every byte is checked before use)."""
    path = Path(path)
    tmp = _temp_name(path)
    try:
        _write_new(tmp, data, mode, sync)
        io_op("rename", path)
        os.replace(tmp, path)
    except BaseException:
        io_op("unlink", tmp)  # after a simulated crash this raises again: a dead process cleans nothing up
        tmp.unlink(missing_ok=True)
        raise
    if not sync:
        return
    try:
        fsync_dir(path.parent)
    except FileNotFoundError:
        if not parent_may_move:
            raise


def write_json_atomic(path: Path, obj: Any, *, parent_may_move: bool = False) -> None:
    write_bytes_atomic(path, json_bytes(obj), parent_may_move=parent_may_move)


def json_bytes(obj: Any) -> bytes:
    """The one JSON encoding of files this pipeline writes (sorted keys, indented, newline-terminated)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def create_exclusive(path: Path, data: bytes, mode: int = 0o644) -> bool:
    """Create ``path`` holding all of ``data``; return False, changing nothing, if ``path`` already exists.

    The data is written and fsynced under a unique temp name, then hard-linked onto ``path``: ``link`` fails
    if the name exists, atomically on local filesystems and NFS alike, so of two creators exactly one wins and
    no reader sees a partial file. On NFS a retransmitted ``link`` can report failure after it succeeded, so
    the temp file's link count decides (as in open(2)'s advice on lock files). The temp name is always removed.
    """
    path = Path(path)
    tmp = _temp_name(path)  # a name every sweep of temp litter knows (a creator that died leaves it)
    try:
        _write_new(tmp, data, mode)
        try:
            io_op("link", path)
            os.link(tmp, path)
        except OSError as e:
            if os.stat(tmp).st_nlink != 2:
                if isinstance(e, FileExistsError):
                    return False
                raise
    finally:
        io_op("unlink", tmp)
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def read_json(path: Path) -> Any:
    """A JSON file, read again briefly while it does not parse (another node's replace, seen through a shared
    mount: see :mod:`pipeline.storage.settle`)."""
    return parse_settled(path.read_bytes, json.loads, (ValueError,))


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (bottom-up), so a later rename publishes durable data."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def _drop_temp_litter(root: Path) -> None:
    """Remove :func:`write_bytes_atomic` temp files that a writer which died before its rename left in ``root``:
    they are never content, and a published directory must not carry a partial file."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            if is_temp_name(name):
                io_op("unlink", Path(dirpath) / name)
                (Path(dirpath) / name).unlink(missing_ok=True)


def publish_dir(staged: Path, final: Path) -> None:
    """Atomically move a fully written directory into place. ``final`` must not exist.

    The caller owns ``staged`` (every writer into it has finished): temp files that crashed writers left there
    are dropped, everything is fsynced, then one rename publishes it and both parents are fsynced. A symlink
    is never published (nor followed to fsync what it points at).
    """
    try:  # one lstat: a dir moved away between two looks (another committer published it) is a race, not a link
        mode = os.lstat(staged).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, "nothing to publish: it was moved or removed meanwhile", str(staged)
        ) from None
    if not stat.S_ISDIR(mode):
        raise UnsafePathError(f"cannot publish {staged}: it is a symlink or not a directory; links are never published")
    if os.path.lexists(final):
        raise PipelineError(
            f"cannot publish {staged} to {final}: the destination already exists; "
            "a published directory is never overwritten (rerun with force to redo the stage)"
        )
    _drop_temp_litter(staged)
    fsync_tree(staged)
    io_op("rename", final)
    os.rename(staged, final)
    fsync_dir(final.parent)
    if staged.parent != final.parent:
        fsync_dir(staged.parent)


def move_aside(path: Path, dest_dir: Path, name: str, *, sync: bool = True) -> Path:
    """Rename ``path`` into ``dest_dir/name`` (quarantine, retired outputs); never deletes. ``sync=False``: the
    dirs are not fsynced (as for :func:`write_bytes_atomic`)."""
    if not dest_dir.is_dir():
        io_op("mkdir", dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / name
    n = 1
    while os.path.lexists(dest):  # a dangling link counts: nothing is ever replaced here
        dest = dest_dir / f"{name}.{n}"
        n += 1
    io_op("rename", dest)
    os.rename(path, dest)
    if sync:
        fsync_dir(dest_dir)
        fsync_dir(path.parent)
    return dest


def replace_file(src: Path, dst: Path, *, sync: bool = True) -> None:
    """Rename the finished file ``src`` over ``dst`` (readers see the old file or the new one, never a part)."""
    io_op("rename", dst)
    os.replace(src, dst)
    if sync:
        fsync_dir(dst.parent)


def overwrite_file(path: Path, data: memoryview, *, sync: bool = True) -> None:
    """All of ``data`` into the existing file ``path`` (no reader has it: a temp name) from its start, in place:
    its pages are reused, not allocated again."""
    io_op("write", path)
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a link is refused, never written through
    try:
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)
        if sync:
            io_op("fsync", path)
            os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree_tolerant(path: Path) -> None:
    """``rmtree`` that lets entries vanish under it (another remover of the same trash got there first)."""

    def onerror(_func: Any, _path: str, exc_info: Any) -> None:
        if not issubclass(exc_info[0], FileNotFoundError):
            raise exc_info[1]

    io_op("rmtree", path)
    if os.path.islink(path):
        path.unlink(missing_ok=True)
        return
    shutil.rmtree(path, onerror=onerror)


def remove_tree(path: Path) -> None:
    """Delete a directory tree (only the one owner of ``path`` may call this, e.g. prepare-dirs on overwrite).

    The tree is first renamed to a hidden sibling with a unique name, so a crash mid-delete never leaves a
    half-deleted directory under the original name. A concurrent removal is tolerated: if ``path`` is gone by
    the time of the rename, someone else removed (or moved) it and there is nothing to do. Trash left by an
    earlier remover that died mid-delete is removed too.
    """
    path = Path(path)
    trash = path.with_name(f".{path.name}.deleting-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        io_op("rename", trash)
        os.rename(path, trash)
    except FileNotFoundError:
        pass
    else:
        fsync_dir(path.parent)
        _rmtree_tolerant(trash)
    for old in path.parent.glob(f".{glob.escape(path.name)}.deleting-*"):
        _rmtree_tolerant(old)


def clear_file(path: Path) -> None:
    """Remove a rank-private or owner-private file if present (e.g. a stale done-marker before a re-save)."""
    io_op("unlink", path)
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_dir(path.parent)


def link_file(src: Path, dst: Path) -> None:
    """Make ``dst`` a hard link to the regular file ``src`` (a link at ``src`` itself is never followed), replacing
    a stale ``dst``: a rank-private name in a staging dir, sharing a committed file's bytes. Nothing is written
    through either name; the link's directory entry is fsync'd before the marker can name it."""
    if os.path.lexists(dst):
        clear_file(dst)
    io_op("link", dst)
    os.link(src, dst, follow_symlinks=False)
    fsync_file(dst)  # durable since its first write; fsync'd under this name too, like every file of a step
    fsync_dir(dst.parent)


def copy_file_atomic(src: Path, dst: Path, chunk: int = 8 << 20) -> tuple[int, str]:
    """Copy ``src`` (a regular file, never through a symlink) to ``dst`` atomically, hashing (xxh3-128) while
    copying; returns ``(size, hash)`` of the bytes written (what a marker records)."""
    import xxhash  # noqa: PLC0415

    dst = Path(dst)
    tmp = _temp_name(dst)
    hasher = xxhash.xxh3_128()
    size = 0
    src_fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        io_op("create", tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            while data := os.read(src_fd, chunk):
                hasher.update(data)
                view = memoryview(data)
                while view:
                    io_op("write", tmp)
                    view = view[os.write(fd, view) :]
                size += len(data)
            io_op("fsync", tmp)
            os.fsync(fd)
        finally:
            os.close(fd)
        io_op("rename", dst)
        os.replace(tmp, dst)
    except BaseException:
        io_op("unlink", tmp)
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(src_fd)
    fsync_dir(dst.parent)
    return size, hasher.hexdigest()
