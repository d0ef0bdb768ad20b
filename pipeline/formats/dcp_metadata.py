"""DCP ``.metadata``, read without unpickling untrusted bytes and without importing torch.

DCP stores its ``.metadata`` with ``pickle``. :func:`read_metadata_safe` reads it with a restricted unpickler
that resolves DCP's metadata classes to the plain mirrors below (same names, same fields, same pickled state),
and torch's value types to stand-ins (:class:`Size`, a tuple; :class:`TorchName`, a dtype or layout by name),
so reading a step's metadata costs neither arbitrary code nor ``import torch`` (about 3 CPU-seconds and 300 MB
per process), which matters to the committer, which only reads. The result is then checked against the
directory: typed fields, chunks inside their tensors, every stored byte range inside a regular data file reached
by a safe relative path. :meth:`TensorProperties.torch_dtype` gives the dtype to code that builds tensors;
:func:`to_torch` turns the whole into torch's own classes for ``dcp.load`` (:mod:`pipeline.formats.dcp`).
"""

from __future__ import annotations

import collections
import enum
import io
import itertools
import math
import os
import pathlib
import pickle
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import CheckpointFormatError
from pipeline.formats.dcp_names import METADATA_FILE
from pipeline.formats.dcp_values import DTYPES, MEMORY_FORMATS, STRIDED, Size, TorchName, layout
from pipeline.formats.pickle_safety import check_opcodes, error_summary
from pipeline.storage.integrity import SafeRoot, safe_join

if TYPE_CHECKING:
    import torch


# Mirrors of torch.distributed.checkpoint.metadata's classes and filesystem._StorageInfo (torch 2.x): pickled
# DCP metadata unpickles into them field for field.
@dataclass
class ChunkStorageMetadata:
    offsets: Size
    sizes: Size


class _MEM_FORMAT_ENCODING(enum.Enum):  # noqa: N801 - DCP's name, resolved by the unpickler
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEMORY_FORMATS = {
    _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: TorchName("memory_format", "contiguous_format"),
    _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: TorchName("memory_format", "channels_last"),
    _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: TorchName("memory_format", "preserve_format"),
}


@dataclass
class TensorProperties:
    dtype: Any = None
    layout: Any = None
    requires_grad: bool = False
    memory_format: Any = None
    pin_memory: bool = False

    def __setstate__(self, state: object) -> None:
        if not (isinstance(state, tuple) and len(state) == 5) or state[3] not in _MEMORY_FORMATS:
            raise pickle.UnpicklingError("malformed TensorProperties state")
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        self.memory_format = _MEMORY_FORMATS[encoding]

    def torch_dtype(self) -> torch.dtype:
        """The tensor's dtype as torch's own (imports torch; ``read_metadata_safe`` checked it is a dtype's name)."""
        return self.dtype.resolve()


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: list[str] | None = None


_MIRRORS: dict[tuple[str, str], type] = {
    **{
        ("torch.distributed.checkpoint.metadata", c.__name__): c
        for c in (
            Metadata,
            MetadataIndex,
            TensorStorageMetadata,
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            StorageMeta,
            _MEM_FORMAT_ENCODING,
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Restricted unpickler: only DCP's metadata dataclasses and a few torch/pathlib value types resolve."""

    def find_class(self, module: str, name: str) -> Any:
        mirror = _MIRRORS.get((module, name))
        if mirror is not None:
            return mirror
        if module == "torch" and name == "Size":
            return Size
        if module == "torch" and name in DTYPES:
            return TorchName("dtype", name)
        if module == "torch" and name in MEMORY_FORMATS:
            return TorchName("memory_format", name)
        if module == "torch.serialization" and name == "_get_layout":
            return layout  # DCP's pickle maps the name "torch.strided" to the layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"):
            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


MAX_METADATA_BYTES = 1 << 30
"""Largest ``.metadata`` read (a model with millions of stored chunks stays far below it)."""


def _refusal(file: Path, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{file}: {problem}; it is not DCP metadata this pipeline reads safely "
        "(restore the step from an intact copy or save it again)"
    )


def _read_metadata_bytes(path: Path) -> bytes:
    """The bytes of ``path/.metadata``: a regular file (never a symlink or a FIFO) of bounded size."""
    file = path / METADATA_FILE
    try:
        safe_join(path, METADATA_FILE)  # refuses a symlinked step dir or .metadata
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{file} is missing: {path} is not a DCP checkpoint") from None
    except OSError as e:
        raise _refusal(file, f"cannot be opened ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory with its own error
        os.close(fd)
        raise _refusal(file, "not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise _refusal(file, f"larger than {MAX_METADATA_BYTES} bytes")
    return data


def read_metadata_safe(path: Path) -> Metadata:
    """Unpickle DCP ``.metadata`` allowing only DCP's own metadata classes (never arbitrary callables), then
    check that it is what DCP writes: typed fields, chunks inside their tensors, and every stored byte range
    inside a regular data file of ``path`` reached by a safe relative path.

    Every failure is a :class:`CheckpointFormatError` (an unsafe data path: :class:`UnsafePathError`).
    """
    file = path / METADATA_FILE
    data = _read_metadata_bytes(path)
    check_opcodes(data, file, _refusal)
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # any failure of the restricted unpickler on hostile bytes is a format error
        raise _refusal(file, f"cannot be unpickled safely ({type(e).__name__}: {error_summary(e)})") from None
    try:
        _check_metadata(md, file)
    except AttributeError as e:  # BUILD can leave out any dataclass field
        raise _refusal(file, f"a field DCP writes is missing ({error_summary(e)})") from None
    _check_storage(path, md, file)
    return md


def _dims(value: object) -> tuple[int, ...] | None:
    """``value`` as a shape or an offset (a torch.Size of ints >= 0), or None if it is not one."""
    if not isinstance(value, Size) or not all(type(d) is int and d >= 0 for d in value):
        return None
    return tuple(value)


def _check_metadata(md: object, file: Path) -> None:
    """Structure and types of an unpickled ``Metadata``, as DCP writes it (pure: reads no files)."""
    if not isinstance(md, Metadata):
        raise _refusal(file, f"holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise _refusal(file, "state_dict_metadata and storage_data must be dicts")
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        raise _refusal(file, "planner_data must be a dict")
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        raise _refusal(file, "storage_meta must be a StorageMeta")
    if md.version is not None and not isinstance(md.version, str):
        raise _refusal(file, "version must be a string")
    stored = _stored_keys(md, file)
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _refusal(file, f"state_dict_metadata key {key!r} is not a string")
        if isinstance(item, BytesStorageMetadata):
            if (key, None) not in stored:
                raise _refusal(file, f"{key!r} has no storage_data entry")
        elif isinstance(item, TensorStorageMetadata):
            _check_tensor(key, item, stored, file)
        else:
            raise _refusal(file, f"{key!r} is described by a {type(item).__name__}")


def _stored_keys(md: Metadata, file: Path) -> set[tuple[str, tuple[int, ...] | None]]:
    """``(fqn, chunk offsets)`` of every well-formed ``storage_data`` entry (offsets None for bytes items)."""
    stored: set[tuple[str, tuple[int, ...] | None]] = set()
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise _refusal(file, f"storage_data key {type(index).__name__} is not a MetadataIndex")
        offset = None if index.offset is None else _dims(index.offset)
        if index.offset is not None and offset is None:
            raise _refusal(file, f"storage_data of {index.fqn!r} has a malformed offset")
        if not (
            isinstance(info, _StorageInfo)
            and isinstance(info.relative_path, str)
            and type(info.offset) is int
            and type(info.length) is int
            and info.offset >= 0
            and info.length >= 0
            and _descriptors_ok(info.transform_descriptors)
        ):
            raise _refusal(file, f"storage_data of {index.fqn!r} is not a well-formed _StorageInfo")
        stored.add((index.fqn, offset))
    return stored


def _descriptors_ok(descriptors: object) -> bool:
    """``_StorageInfo.transform_descriptors``: None or the list of names DCP writes (e.g. of a compression)."""
    return descriptors is None or (type(descriptors) is list and all(isinstance(d, str) for d in descriptors))


def _check_tensor(
    key: str, item: TensorStorageMetadata, stored: set[tuple[str, tuple[int, ...] | None]], file: Path
) -> None:
    props, size = item.properties, _dims(item.size)
    if not (
        isinstance(props, TensorProperties)
        and isinstance(props.dtype, TorchName)
        and props.dtype.kind == "dtype"
        and props.layout == STRIDED
    ):
        raise _refusal(file, f"tensor {key!r} has malformed properties (dtype, strided layout)")
    if size is None or not isinstance(item.chunks, list):
        raise _refusal(file, f"tensor {key!r} has a malformed size or chunk list")
    covered = 0
    for chunk in item.chunks:
        offsets = _dims(getattr(chunk, "offsets", None)) if isinstance(chunk, ChunkStorageMetadata) else None
        sizes = _dims(getattr(chunk, "sizes", None)) if offsets is not None else None
        if offsets is None or sizes is None or not len(offsets) == len(sizes) == len(size):
            raise _refusal(file, f"tensor {key!r} has a malformed chunk")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise _refusal(file, f"tensor {key!r} {list(size)}: chunk {list(sizes)} at {list(offsets)} lies outside")
        if (key, offsets) not in stored:
            raise _refusal(file, f"tensor {key!r}: chunk at {list(offsets)} has no storage_data entry")
        covered += math.prod(sizes)
    if covered != math.prod(size):
        raise _refusal(file, f"tensor {key!r} {list(size)}: its chunks hold {covered} of {math.prod(size)} elements")


def _check_storage(path: Path, md: Metadata, file: Path) -> None:
    """Every stored byte range lies inside its data file, and no two ranges overlap (so a tensor never needs
    more memory than the data files hold)."""
    ranges: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for info in md.storage_data.values():
        ranges[info.relative_path].append((info.offset, info.offset + info.length))
    under = SafeRoot(path)  # each directory on the way is checked once, not once per data file
    for rel, spans in ranges.items():
        try:
            data_file = under.join(rel)  # relative, normalised, no symlink on the way
            st = os.lstat(data_file)
        except FileNotFoundError:
            raise _refusal(file, f"it references {rel!r}, which is missing") from None
        except OSError as e:
            raise _refusal(file, f"it references {rel!r}, which cannot be read ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise _refusal(file, f"it references {rel!r}, which is not a regular file")
        spans.sort()
        if spans[-1][1] > st.st_size:
            raise _refusal(file, f"it references bytes up to {spans[-1][1]} of {rel!r}, which has {st.st_size}")
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise _refusal(file, f"two stored items overlap in {rel!r} at byte {start}")


def stored_files(path: Path) -> set[str]:
    """The data files a DCP checkpoint's ``.metadata`` stores bytes in (read safely), plus ``.metadata`` itself:
    what the markers of a step must list, so that no file of the checkpoint goes unverified."""
    md = read_metadata_safe(path)
    return {str(info.relative_path) for info in md.storage_data.values()} | {METADATA_FILE}


def tensor_entries(md: Metadata, prefix: str) -> Iterator[tuple[str, TensorStorageMetadata]]:
    """Tensors whose flattened key starts with ``prefix`` (e.g. ``model.``), in sorted key order."""
    for key in sorted(md.state_dict_metadata):
        item = md.state_dict_metadata[key]
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            yield key, item


def to_torch(md: Metadata) -> Any:
    """``md`` as torch's own DCP metadata objects (for ``dcp.load``; imports torch's DCP package)."""
    import torch  # noqa: PLC0415 - only where DCP loads
    from torch.distributed.checkpoint import metadata as dcp_meta  # noqa: PLC0415
    from torch.distributed.checkpoint.filesystem import _StorageInfo as TorchStorageInfo  # noqa: PLC0415

    def value(v: Any) -> Any:
        return v.resolve() if isinstance(v, TorchName) else v

    def props(p: TensorProperties) -> Any:
        return dcp_meta.TensorProperties(
            dtype=value(p.dtype),
            layout=value(p.layout),
            requires_grad=p.requires_grad,
            memory_format=value(p.memory_format),
            pin_memory=p.pin_memory,
        )

    def item(m: TensorStorageMetadata | BytesStorageMetadata) -> Any:
        if isinstance(m, BytesStorageMetadata):
            return dcp_meta.BytesStorageMetadata()
        chunks = [
            dcp_meta.ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in m.chunks
        ]
        return dcp_meta.TensorStorageMetadata(properties=props(m.properties), size=torch.Size(m.size), chunks=chunks)

    storage_meta = None
    if md.storage_meta is not None:
        s = md.storage_meta
        storage_meta = dcp_meta.StorageMeta(
            checkpoint_id=s.checkpoint_id, save_id=s.save_id, load_id=s.load_id, modules=list(s.modules)
        )
    return dcp_meta.Metadata(
        state_dict_metadata={k: item(m) for k, m in md.state_dict_metadata.items()},
        planner_data=md.planner_data,
        storage_data={
            dcp_meta.MetadataIndex(
                i.fqn, None if i.offset is None else torch.Size(i.offset), i.index
            ): TorchStorageInfo(s.relative_path, s.offset, s.length, s.transform_descriptors)
            for i, s in md.storage_data.items()
        },
        storage_meta=storage_meta,
        version=md.version,
    )
