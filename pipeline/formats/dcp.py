"""Adapter for torch Distributed Checkpoint (DCP) directories, read without unpickling untrusted bytes.

DCP stores its ``.metadata`` with ``pickle`` and non-tensor values with ``torch.save``; stock
``FileSystemReader``/``DefaultLoadPlanner`` read them with full unpickling. :class:`SafeReader` reads the
metadata with a restricted unpickler (DCP's own metadata classes and a few value types allow-listed, nothing
callable) and then checks its structure against the directory (:func:`read_metadata_safe`), and
:class:`SafeLoadPlanner` loads non-tensor values with ``weights_only=True``. Tensor chunks are already read
with ``weights_only=True`` by torch. Every way hostile bytes can fail a read ends in a typed error.
"""

from __future__ import annotations

import collections
import io
import itertools
import math
import os
import pathlib
import pickle
import stat
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from pipeline.errors import CheckpointFormatError, PipelineError
from pipeline.formats.pickle_safety import check_opcodes, error_summary
from pipeline.storage.faults import io_op
from pipeline.storage.integrity import FileEntry, SafeRoot, safe_join

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


def read_metadata_safe(path: Path) -> dcp_meta.Metadata:
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
    if not isinstance(value, torch.Size) or not all(type(d) is int and d >= 0 for d in value):
        return None
    return tuple(value)


def _check_metadata(md: object, file: Path) -> None:
    """Structure and types of an unpickled ``Metadata``, as DCP writes it (pure: reads no files)."""
    if not isinstance(md, dcp_meta.Metadata):
        raise _refusal(file, f"holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise _refusal(file, "state_dict_metadata and storage_data must be dicts")
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        raise _refusal(file, "planner_data must be a dict")
    if md.storage_meta is not None and not isinstance(md.storage_meta, dcp_meta.StorageMeta):
        raise _refusal(file, "storage_meta must be a StorageMeta")
    if md.version is not None and not isinstance(md.version, str):
        raise _refusal(file, "version must be a string")
    stored = _stored_keys(md, file)
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _refusal(file, f"state_dict_metadata key {key!r} is not a string")
        if isinstance(item, dcp_meta.BytesStorageMetadata):
            if (key, None) not in stored:
                raise _refusal(file, f"{key!r} has no storage_data entry")
        elif isinstance(item, dcp_meta.TensorStorageMetadata):
            _check_tensor(key, item, stored, file)
        else:
            raise _refusal(file, f"{key!r} is described by a {type(item).__name__}")


def _stored_keys(md: dcp_meta.Metadata, file: Path) -> set[tuple[str, tuple[int, ...] | None]]:
    """``(fqn, chunk offsets)`` of every well-formed ``storage_data`` entry (offsets None for bytes items)."""
    stored: set[tuple[str, tuple[int, ...] | None]] = set()
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_meta.MetadataIndex) or not isinstance(index.fqn, str):
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
    key: str, item: dcp_meta.TensorStorageMetadata, stored: set[tuple[str, tuple[int, ...] | None]], file: Path
) -> None:
    props, size = item.properties, _dims(item.size)
    if not (
        isinstance(props, dcp_meta.TensorProperties)
        and isinstance(props.dtype, torch.dtype)
        and props.layout is torch.strided
    ):
        raise _refusal(file, f"tensor {key!r} has malformed properties (dtype, strided layout)")
    if size is None or not isinstance(item.chunks, list):
        raise _refusal(file, f"tensor {key!r} has a malformed size or chunk list")
    covered = 0
    for chunk in item.chunks:
        offsets = _dims(getattr(chunk, "offsets", None)) if isinstance(chunk, dcp_meta.ChunkStorageMetadata) else None
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


def _check_storage(path: Path, md: dcp_meta.Metadata, file: Path) -> None:
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

    def __init__(self, on_file: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.digests: dict[str, FileEntry] = {}
        self._on_file = on_file

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if self._on_file is not None:
            self._on_file(Path(path).name)
        io_op("create", path)
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


@contextmanager
def crc32_off() -> Iterator[None]:
    """``torch.save`` without its per-record zip CRC32 while saving: every byte is already hashed with xxh3
    as it is written (and verified by the committer), and the CRC caps one core at about 1.1 GB/s. Records
    written so still load with plain ``torch.load`` / ``dcp.load`` (the reader does not check the CRC)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class RecordingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that records which data files this rank wrote, with sizes and hashes computed
    while writing (for its done-marker); ``.metadata`` is not among them (it is renamed into place).

    Every file is fsynced when closed by the stream itself (so the fsync is a counted I/O operation), which
    is why DCP's own ``sync_files`` is off. ``threads`` > 1 splits this rank's items by size over that many
    files written in parallel (``__K_0.distcp`` … ``__K_{threads-1}.distcp``), each with its own fsync.
    """

    def __init__(self, path: Path, threads: int = 1, on_file: Callable[[str], None] | None = None) -> None:
        """``on_file(name)`` is called as each file is opened for writing (progress of a background writer)."""
        super().__init__(str(path), sync_files=False, overwrite=True, thread_count=max(1, threads))
        self._hashing_fs = _HashingFileSystem(on_file)
        self.fs = self._hashing_fs
        self.written: list[FileEntry] = []

    def storage_meta(self) -> dcp_meta.StorageMeta | None:
        """None: DCP would record the staging path and a random save id, so equal training states would give
        different ``.metadata`` bytes; without them a step's files depend on the training state alone (a run
        on SLURM and one on this machine with the same seed commit identical hashes)."""
        return None

    def write_data(self, plan: Any, planner: Any) -> Any:
        with crc32_off():
            results = super().write_data(plan, planner).wait()
        if len(results) != len(plan.items):  # DCP's extra writer threads die silently, their items unwritten
            raise OSError(
                f"{self.path}: DCP wrote {len(results)} of this rank's {len(plan.items)} items (a writer thread "
                "failed, see its traceback above); the step is not saved"
            )
        # DCP lists results in the order its writer threads finished: sorted, ``.metadata`` depends on the
        # state alone (a racy order would give equal states different metadata bytes).
        results.sort(key=lambda r: (r.storage_data.relative_path, r.storage_data.offset))
        fut: torch.futures.Future[list[Any]] = torch.futures.Future()
        fut.set_result(results)
        names = sorted({r.storage_data.relative_path for r in results})
        self.written = [self._hashing_fs.digests[n] for n in names]
        # DCP opens one file per writer thread even when its share of the items is empty: such a file holds
        # nothing the metadata names, so this rank removes its own empty file rather than leave it unlisted.
        for name in sorted(set(self._hashing_fs.digests) - set(names)):
            if self._hashing_fs.digests[name].size == 0:
                self._hashing_fs.rm_file(os.path.join(self.path, name))
        return fut


def load_into(
    state: dict[str, Any],
    path: Path,
    process_group: Any = None,
    no_dist: bool = False,
    metadata: dcp_meta.Metadata | None = None,
) -> None:
    """``dcp.load`` of the checkpoint at ``path`` into ``state``, through the safe reader and planner.

    A failure on any rank is one typed error: the first :class:`PipelineError` a rank raised (e.g. the
    metadata refusal), else a :class:`CheckpointFormatError` naming the rank and the cause. DCP's own
    ``CheckpointException`` is a ``BaseException`` that would slip past every ``except Exception``.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                storage_reader=SafeReader(str(path), metadata),
                planner=SafeLoadPlanner(allow_partial_load=no_dist),
                process_group=process_group,
                no_dist=no_dist,
            )
    except CheckpointException as e:
        failures = sorted((rank, exc) for rank, (exc, _trace) in e.failures.items())
        typed = [exc for _, exc in failures if isinstance(exc, PipelineError)]
        if typed:
            raise typed[0] from None
        rank, exc = failures[0] if failures else (-1, e)
        raise _load_failure(path, f"rank {rank}: {type(exc).__name__}: {error_summary(exc)}") from None
    except PipelineError:
        raise
    except Exception as e:
        raise _load_failure(path, f"{type(e).__name__}: {error_summary(e)}") from None


def _load_failure(path: Path, cause: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"cannot load the DCP checkpoint {path} ({cause}); if its files were changed since the commit, "
        "run stage=verify_manifest to check them against the manifest"
    )


def stored_files(path: Path) -> set[str]:
    """The data files a DCP checkpoint's ``.metadata`` stores bytes in (read safely), plus ``.metadata`` itself:
    what the markers of a step must list, so that no file of the checkpoint goes unverified."""
    md = read_metadata_safe(path)
    return {str(info.relative_path) for info in md.storage_data.values()} | {METADATA_FILE}


def tensor_entries(md: dcp_meta.Metadata, prefix: str) -> Iterator[tuple[str, dcp_meta.TensorStorageMetadata]]:
    """Tensors whose flattened key starts with ``prefix`` (e.g. ``model.``), in sorted key order."""
    for key in sorted(md.state_dict_metadata):
        item = md.state_dict_metadata[key]
        if key.startswith(prefix) and isinstance(item, dcp_meta.TensorStorageMetadata):
            yield key, item
