"""Shared pieces of a DCP step: what does not change between saves, written once and shared by later steps.

A rank's items whose FQN is in a shared group (``frozen``: parameters that do not train; ``buffers``) are written
into files of their own, ``__K_<group><n>.distcp``, apart from DCP's ``__K_<n>.distcp``. Before writing such a
file the rank serialises its items into a hashing sink (no I/O): when the latest committed step holds a file of
the same name with the same size and xxh3-128, that file's bytes are exactly what would be written, so the rank
makes it part of this step instead (:attr:`Pieces.reuse`: a hard link on POSIX, a reference to the same object
in a bucket) and DCP's metadata records the same offsets a write would have given. Otherwise it is written.

Every step stays complete: its marker lists the piece with size and hash like any file, the committer re-reads
and checks it, and plain ``dcp.load`` reads the step. A piece's bytes are the same for the same items whatever
else the step holds: the items are serialised in one order of our own (DCP's loader may reorder by size).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import xxhash
from torch.distributed.checkpoint.filesystem import (
    _item_size,
    _SerialCpuLoader,
    _split_by_size_and_type,
    _write_item,
)
from torch.distributed.checkpoint.planner import WriteItemType

from pipeline.formats.dcp_names import SHARED_GROUPS, piece_name
from pipeline.storage.integrity import FileEntry

Reuse = Callable[[str], bool]
"""``reuse(name)``: make the latest committed step's file ``name`` part of the step being written (True), or
say it cannot (False: the file is written)."""


@dataclass(frozen=True)
class Pieces:
    """How one rank's save may share pieces with the latest committed step."""

    groups: Mapping[str, str]
    """Flattened DCP FQN (``model.layer.weight``) -> shared group, for the items saved apart."""
    previous: Mapping[str, FileEntry] = field(default_factory=dict)
    """This rank's piece files in the latest committed step, by name, as its manifest records them."""
    reuse: Reuse = lambda _name: False


def split(items: list[Any], groups: Mapping[str, str], rank: int, files: int) -> tuple[list[Any], dict[str, list]]:
    """``items`` as (the rest, {piece file name: its items}): each shared group's tensor items split by size over
    at most ``files`` files, deterministically (the same items give the same names and contents)."""
    rest: list[Any] = []
    by_group: dict[str, list[Any]] = {}
    for item in items:
        group = groups.get(item.index.fqn) if item.type != WriteItemType.BYTE_IO else None
        if group in SHARED_GROUPS:
            by_group.setdefault(group, []).append(item)
        else:
            rest.append(item)
    pieces: dict[str, list[Any]] = {}
    for group, members in sorted(by_group.items()):
        members.sort(key=lambda i: (i.index.fqn, tuple(i.index.offset or ())))
        buckets = [b for b in _split_by_size_and_type(max(1, min(files, len(members))), members) if b]
        for n, bucket in enumerate(buckets):
            pieces[piece_name(rank, group, n)] = bucket
    return rest, pieces


class _DigestSink(io.RawIOBase):
    """Where a piece is serialised to learn its size and hash without writing it."""

    def __init__(self) -> None:
        super().__init__()
        self.hasher = xxhash.xxh3_128()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size


def serialize(stream: Any, name: str, items: list[Any], planner: Any, writer: Any) -> list[Any]:
    """Write ``items`` into ``stream`` in our one order, as DCP writes an item: their write results."""
    loader = _SerialCpuLoader(planner.resolve_data)
    for item in items:
        loader.add(_item_size(item), item)
    out: list[Any] = []
    for tensor, item in loader.values():
        out.append(_write_item(writer.transforms, stream, tensor, cast(Any, item), name, writer.serialization_format))
    return out


def write_pieces(writer: Any, pieces: Pieces, shared: dict[str, list], planner: Any, threads: int) -> tuple[list, set]:
    """Each piece file of ``shared``, reused when unchanged or written (through ``writer.fs``, so it is hashed
    and fsync'd like DCP's files; a stale file of that name is unlinked first, never written through); returns
    the write results and the names reused."""

    def one(name: str) -> tuple[list[Any], bool]:
        items = shared[name]
        before = pieces.previous.get(name)
        if before is not None:
            sink = _DigestSink()
            results = serialize(sink, name, items, planner, writer)
            unchanged = (sink.size, sink.hasher.hexdigest()) == (before.size, before.hash)
            if unchanged and pieces.reuse(name):
                writer.fs.digests[name] = FileEntry(path=name, size=sink.size, hash=before.hash)
                return results, True
        with writer.fs.create_stream(writer.fs.concat_path(writer.path, name), "wb") as stream:
            results = serialize(stream, name, items, planner, writer)
        return results, False

    out: list[Any] = []
    reused: set[str] = set()
    with ThreadPoolExecutor(max(1, min(threads, len(shared)))) as pool:
        for name, (results, was_reused) in zip(shared, pool.map(one, shared), strict=True):
            out += results
            if was_reused:
                reused.add(name)
    return out, reused
