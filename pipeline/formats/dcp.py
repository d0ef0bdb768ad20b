"""Adapter for torch Distributed Checkpoint (DCP) directories, read without unpickling untrusted bytes.

DCP stores its ``.metadata`` with ``pickle`` and non-tensor values with ``torch.save``; stock
``FileSystemReader``/``DefaultLoadPlanner`` read them with full unpickling. :class:`SafeReader` reads the
metadata with torch's weights-only unpickler (DCP's own metadata classes allow-listed) and
:class:`SafeLoadPlanner` loads non-tensor values with ``weights_only=True``. Tensor chunks are already read
with ``weights_only=True`` by torch.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import warnings
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from pipeline.errors import CheckpointFormatError
from pipeline.storage.faults import io_op
from pipeline.storage.integrity import FileEntry

METADATA_FILE = ".metadata"
FORMAT = "torch_dcp"

_DCP_CLASSES = {
    "Metadata",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}


class _MetadataUnpickler(pickle.Unpickler):
    """Restricted unpickler: only DCP's metadata dataclasses and a few torch/pathlib value types resolve."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name in _DCP_CLASSES:
            return getattr(dcp_meta, name)
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            return _StorageInfo
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout  # maps a layout name such as "torch.strided" to the layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"):
            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_metadata_safe(path: Path) -> dcp_meta.Metadata:
    """Unpickle DCP ``.metadata`` allowing only DCP's own metadata classes (never arbitrary callables)."""
    file = path / METADATA_FILE
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointFormatError(f"{file} is missing: {path} is not a DCP checkpoint") from None
    except Exception as e:
        raise CheckpointFormatError(f"refusing to read {file}: it is not plain DCP metadata ({e})") from e
    if not isinstance(md, dcp_meta.Metadata):
        raise CheckpointFormatError(f"{file} holds {type(md).__name__}, not DCP metadata")
    return md


class SafeReader(FileSystemReader):
    """``FileSystemReader`` with the restricted metadata reader; ``metadata`` skips re-reading it per load."""

    def __init__(self, path: str, metadata: dcp_meta.Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        md = self._metadata if self._metadata is not None else read_metadata_safe(Path(self.path))
        storage_meta = md.storage_meta if md.storage_meta is not None else dcp_meta.StorageMeta()
        storage_meta.load_id = self.load_id
        md.storage_meta = storage_meta
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _HashingStream:
    """Passes writes through to ``raw`` and hashes them on the way (xxh3-128), so no file is read back.

    Each write, and the fsync in :meth:`close`, is a counted I/O operation (:func:`~pipeline.storage.faults.io_op`).
    """

    def __init__(self, raw: IO[bytes], path: str) -> None:
        self.raw = raw
        self.path = path
        self.hasher = xxhash.xxh3_128()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        io_op("write", self.path)
        written = self.raw.write(view)
        if written != len(view):  # a buffered file writes all or raises; anything else would desync the hash
            raise OSError(f"short write: {written} of {len(view)} bytes")
        self.hasher.update(view)
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        """Flush, fsync and close (once): DCP closes data files itself; ``.metadata`` is closed on leaving its
        stream. An fsync error fails the save."""
        if self.raw.closed:
            return
        try:
            self.raw.flush()
            io_op("fsync", self.path)
            os.fsync(self.raw.fileno())
        finally:
            self.raw.close()


class _HashingFileSystem(FileSystem):
    """DCP's local filesystem with every mutation counted, and a digest of every file written."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, FileEntry] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as raw:
            hashing = _HashingStream(raw, os.fspath(path))
            yield hashing
            hashing.close()
        name = Path(path).name
        self.digests[name] = FileEntry(path=name, size=hashing.size, hash=hashing.hasher.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        io_op("rename", new_path)
        super().rename(path, new_path)

    def mkdir(self, path: str | os.PathLike) -> None:
        if not Path(path).is_dir():
            io_op("mkdir", path)
        super().mkdir(path)

    def rm_file(self, path: str | os.PathLike) -> None:
        io_op("unlink", path)
        super().rm_file(path)


class RecordingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that records which data files this rank wrote, with sizes and hashes computed
    while writing (for its done-marker); ``.metadata`` is not among them (it is renamed into place).

    Every file is fsynced when closed by the stream itself (so the fsync is a counted I/O operation), which
    is why DCP's own ``sync_files`` is off.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), sync_files=False, overwrite=True)
        self._hashing_fs = _HashingFileSystem()
        self.fs = self._hashing_fs
        self.written: list[FileEntry] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        names = sorted({r.storage_data.relative_path for r in fut.wait()})
        self.written = [self._hashing_fs.digests[n] for n in names]
        return fut


def load_into(
    state: dict[str, Any],
    path: Path,
    process_group: Any = None,
    no_dist: bool = False,
    metadata: dcp_meta.Metadata | None = None,
) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            state,
            storage_reader=SafeReader(str(path), metadata),
            planner=SafeLoadPlanner(allow_partial_load=no_dist),
            process_group=process_group,
            no_dist=no_dist,
        )


def tensor_entries(md: dcp_meta.Metadata, prefix: str) -> Iterator[tuple[str, dcp_meta.TensorStorageMetadata]]:
    """Tensors whose flattened key starts with ``prefix`` (e.g. ``model.``), in sorted key order."""
    for key in sorted(md.state_dict_metadata):
        item = md.state_dict_metadata[key]
        if key.startswith(prefix) and isinstance(item, dcp_meta.TensorStorageMetadata):
            yield key, item
