"""An S3-compatible bucket in memory for the simulation: the same operations and conditional-write semantics as
:class:`pipeline.storage.s3.S3Store` (``If-None-Match: *``, ``If-Match: <etag>``, strongly consistent listings, as
S3 has been since 2020), each a point of the simulation's scheduler where a fault can be injected."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from pipeline.storage.s3 import Conflict, ObjectInfo


class MemoryBucket:
    """The objects of every bucket of one simulated world, and the hook that makes each operation a point."""

    def __init__(self, point: Callable[[str, str], None]) -> None:
        self.objects: dict[str, dict[str, tuple[bytes, str]]] = {}
        self.point = point
        self._n = 0

    def store(self, bucket: str) -> MemoryS3:
        return MemoryS3(self, bucket)

    def etag(self) -> str:
        self._n += 1
        return f'"{self._n:08x}"'


class MemoryS3:
    """:class:`pipeline.storage.s3.S3Store`'s interface over :class:`MemoryBucket`."""

    def __init__(self, world: MemoryBucket, bucket: str) -> None:
        self.world = world
        self.bucket = bucket
        self.objs = world.objects.setdefault(bucket, {})

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        self.world.point("s3.put", key)
        have = self.objs.get(key)
        if if_none_match and have is not None:
            raise Conflict(f"conditional PUT of {self.url(key)} refused: PreconditionFailed")
        if if_match is not None and (have is None or have[1] != if_match):
            raise Conflict(f"conditional PUT of {self.url(key)} refused: PreconditionFailed")
        etag = self.world.etag()
        self.objs[key] = (bytes(data), etag)
        return etag

    def get(self, key: str) -> tuple[bytes, str] | None:
        self.world.point("s3.get", key)
        return self.objs.get(key)

    def head(self, key: str) -> ObjectInfo | None:
        self.world.point("s3.head", key)
        have = self.objs.get(key)
        return ObjectInfo(size=len(have[0]), etag=have[1]) if have is not None else None

    def listing(self, prefix: str) -> dict[str, ObjectInfo]:
        self.world.point("s3.list", prefix)
        return {k: ObjectInfo(size=len(v[0]), etag=v[1]) for k, v in sorted(self.objs.items()) if k.startswith(prefix)}

    def children(self, prefix: str) -> list[str]:
        self.world.point("s3.list", prefix)
        names = {k[len(prefix) :].split("/", 1)[0] for k in self.objs if k.startswith(prefix)}
        return sorted(n for n in names if n)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self.world.point("s3.delete", key)
            self.objs.pop(key, None)

    def copy(self, src: str, dst: str) -> None:
        self.world.point("s3.copy", f"{src} -> {dst}")
        have = self.objs.get(src)
        if have is None:
            raise FileNotFoundError(self.url(src))
        self.objs[dst] = (have[0], self.world.etag())

    def upload_file(self, key: str, path: Path, part_size: int = 0) -> tuple[int, str]:
        data = path.read_bytes()
        self.put(key, data)
        return len(data), xxhash.xxh3_128(data).hexdigest()

    def download(self, key: str, size: int, dest: Path | None, part_size: int = 0) -> tuple[int, str]:
        have = self.get(key)
        if have is None:
            raise FileNotFoundError(self.url(key))
        data = have[0]
        if dest is not None:
            dest.write_bytes(data)
        if len(data) < size:
            return -1, ""
        return len(data), xxhash.xxh3_128(data).hexdigest()

    def abort_uploads(self, prefix: str, which: Callable[[str], bool] = lambda _key: True) -> list[str]:
        return []

    def check_conditional_writes(self, prefix: str) -> None:
        return None

    def sweep_probes(self, prefix: str, older_than_s: float | None = None) -> list[str]:
        return []

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the simulated bucket has no {name!r}")
