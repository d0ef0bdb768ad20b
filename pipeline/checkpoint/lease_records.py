"""Where the committer lease's records live (:mod:`pipeline.checkpoint.ownership`): a folder of a (shared)
filesystem, or a prefix of a bucket. One record per holder, each written only by its holder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.storage.atomic import clear_file, write_bytes_atomic
from pipeline.storage.integrity import is_real_dir, lstat_kind
from pipeline.storage.s3 import Conflict, S3Store
from pipeline.storage.settle import parse_settled


class FileLease:
    """The records as files of one (shared) filesystem folder, each replaced whole by write-temp-fsync-rename by
    its one writer. Nothing is ever followed through a link."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.where = str(folder)

    def names(self) -> list[str]:
        if lstat_kind(self.folder) is None:
            return []
        if not is_real_dir(self.folder):
            raise OSError(f"{self.folder} is not a directory (a link or file planted there)")
        return sorted(os.listdir(self.folder))

    def get(self, name: str) -> bytes | None:
        path = self.folder / name
        if lstat_kind(path) != "file":
            return None
        try:  # a record its holder is replacing can read torn through a shared mount: read it again first
            return parse_settled(lambda: self._read(path), _whole_json, (ValueError,))
        except ValueError:
            return self._read(path)  # damaged for good: Holder.parse finds no holder in it
        except FileNotFoundError:
            return None

    @staticmethod
    def _read(path: Path) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            return f.read(1 << 16)

    def put(self, name: str, data: bytes, create: bool) -> bool:
        path = self.folder / name
        if create and lstat_kind(path) is not None:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, data)
        return True

    def delete(self, name: str) -> None:
        clear_file(self.folder / name)


def _whole_json(data: bytes) -> bytes:
    json.loads(data)
    return data


class ObjectLease:
    """The records as objects under ``<root>/committer/``: each created with ``If-None-Match: *`` and then
    rewritten only by its holder."""

    def __init__(self, store: S3Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/") + "/"
        self.where = store.url(self.prefix)

    def names(self) -> list[str]:
        return sorted(k[len(self.prefix) :] for k in self.store.listing(self.prefix))

    def get(self, name: str) -> bytes | None:
        got = self.store.get(self.prefix + name)
        return None if got is None else got[0]

    def put(self, name: str, data: bytes, create: bool) -> bool:
        try:
            self.store.put(self.prefix + name, data, if_none_match=create)
        except Conflict:
            return False
        return True

    def delete(self, name: str) -> None:
        self.store.delete([self.prefix + name])
