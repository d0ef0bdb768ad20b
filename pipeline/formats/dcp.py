"""Adapter for torch Distributed Checkpoint (DCP) directories, read without unpickling untrusted bytes.

DCP stores its ``.metadata`` with ``pickle`` and non-tensor values with ``torch.save``; stock
``FileSystemReader``/``DefaultLoadPlanner`` read them with full unpickling. :class:`SafeReader` reads the
metadata with a restricted unpickler (DCP's own metadata classes and a few value types allow-listed, nothing
callable) and then checks its structure against the directory (:func:`read_metadata_safe`), and
:class:`SafeLoadPlanner` loads non-tensor values with ``weights_only=True``. Tensor chunks are already read
with ``weights_only=True`` by torch. Every way hostile bytes can fail a read ends in a typed error.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from queue import Queue
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _split_by_size_and_type,
)
from torch.distributed.checkpoint.planner import ReadItem

from pipeline.errors import CheckpointFormatError, PipelineError
from pipeline.formats import dcp_pieces
from pipeline.formats.dcp_metadata import (  # noqa: F401 - re-exported: the reader lives there, torch-DCP-free
    MAX_METADATA_BYTES,
    METADATA_FILE,
    Metadata,
    read_metadata_safe,
    stored_files,
    tensor_entries,
    to_torch,
)
from pipeline.formats.dcp_pieces import Pieces
from pipeline.formats.pickle_safety import error_summary, weights_only_reason
from pipeline.storage.faults import io_op
from pipeline.storage.integrity import FileEntry

FORMAT = "torch_dcp"

_converted: list[tuple[Metadata, dcp_meta.Metadata]] = []


def _as_torch(md: Metadata) -> dcp_meta.Metadata:
    """torch's metadata objects for ``md``, converted once for a run of loads of the same step."""
    if not (_converted and _converted[0][0] is md):
        _converted[:] = [(md, to_torch(md))]
    return _converted[0][1]


class SafeReader(FileSystemReader):
    """``FileSystemReader`` with the restricted metadata reader; ``metadata`` skips re-reading it per load."""

    def __init__(self, path: str, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        md = _as_torch(self._metadata if self._metadata is not None else read_metadata_safe(Path(self.path)))
        storage_meta = md.storage_meta if md.storage_meta is not None else dcp_meta.StorageMeta()
        storage_meta.load_id = self.load_id
        md.storage_meta = storage_meta
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    where = ""
    """The checkpoint's path, for the error naming a value the restricted reader refuses."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - refused or unreadable bytes: one line naming the value
            raise CheckpointFormatError(
                f"{self.where}: the value {read_item.dest_index.fqn!r} cannot be loaded by the restricted reader "
                f"({weights_only_reason(e)}); nothing was unpickled. A step this library saved never holds such a "
                "value (save refuses it): was it written by another tool, or changed since?"
            ) from None
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
        if os.path.lexists(path):  # a stale file may be a hard link to a committed step's piece: never write
            self.rm_file(path)  # through it (that would change the committed bytes), unlink it first
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

    def __init__(
        self,
        path: Path,
        threads: int = 1,
        on_file: Callable[[str], None] | None = None,
        pieces: Pieces | None = None,
    ) -> None:
        """``on_file(name)`` is called as each file is opened for writing (progress of a background writer).
        ``pieces``: the items saved apart as shared pieces, and how an unchanged one is reused
        (:mod:`pipeline.formats.dcp_pieces`)."""
        super().__init__(str(path), sync_files=False, overwrite=True, thread_count=max(1, threads))
        self._hashing_fs = _HashingFileSystem(on_file)
        self.fs = self._hashing_fs
        self.pieces = pieces
        self.written: list[FileEntry] = []
        self.reused: set[str] = set()
        """Names of the files taken from the latest committed step, not written (:attr:`written` lists them too)."""

    def storage_meta(self) -> dcp_meta.StorageMeta | None:
        """None: DCP would record the staging path and a random save id, so equal training states would give
        different ``.metadata`` bytes; without them a step's files depend on the training state alone (a run
        on SLURM and one on this machine with the same seed commit identical hashes)."""
        return None

    def write_data(self, plan: Any, planner: Any) -> Any:
        with crc32_off():
            results = self._write_all(plan, planner)
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

    def _write_all(self, plan: Any, planner: Any) -> list[Any]:
        """DCP's write of this rank's items; with :attr:`pieces`, the shared groups' items go to piece files of
        their own first (each reused when unchanged), and DCP writes the rest."""
        pieces = self.pieces
        if pieces is None or not pieces.groups:
            return list(super().write_data(plan, planner).wait())
        prefix = plan.storage_data.prefix
        rest, shared = dcp_pieces.split(plan.items, pieces.groups, int(prefix.strip("_")), self.thread_count)
        results: list[Any] = []
        if shared:
            results, self.reused = dcp_pieces.write_pieces(self, pieces, shared, planner, self.thread_count)
        if rest:
            queue: Queue[tuple[Any, str, list[Any]]] = Queue()
            for n, bucket in enumerate(_split_by_size_and_type(self.thread_count, rest)):
                name = f"{prefix}{n}{DEFAULT_SUFFIX}"
                queue.put((self.fs.concat_path(self.path, name), name, bucket))
            results += self._write_data(planner, queue).wait()
        return results


def load_into(
    state: dict[str, Any],
    path: Path,
    process_group: Any = None,
    no_dist: bool = False,
    metadata: Metadata | None = None,
    partial: bool = False,
    hint: str = "",
) -> list[str]:
    """``dcp.load`` of the checkpoint at ``path`` into ``state``, through the safe reader and planner; returns the
    keys of ``state`` the checkpoint does not hold (left as they are: only with ``partial`` or ``no_dist``; else
    they fail the load in one line naming them, ``hint`` saying how to load the rest).

    A failure on any rank is one typed error: the first :class:`PipelineError` a rank raised (e.g. the
    metadata refusal), else a :class:`CheckpointFormatError` naming the rank and the cause. DCP's own
    ``CheckpointException`` is a ``BaseException`` that would slip past every ``except Exception``.
    """
    if metadata is None:
        metadata = read_metadata_safe(Path(path))
    missing = absent_keys(state, metadata)
    if missing and not (partial or no_dist):
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointFormatError(f"{path} holds no value for {shown} (the state gained it since?){hint}")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                storage_reader=SafeReader(str(path), metadata),
                planner=_planner(path, no_dist or partial),
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
    return missing


def _planner(path: Path, partial: bool) -> SafeLoadPlanner:
    planner = SafeLoadPlanner(allow_partial_load=partial)
    planner.where = str(path)
    return planner


def absent_keys(state: dict[str, Any], metadata: Metadata) -> list[str]:
    """The flattened keys of ``state`` (``extra.epoch``) that the checkpoint described by ``metadata`` lacks."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415 - torch-private

    flat, _ = flatten_state_dict(state)
    return sorted(k for k in flat if k not in metadata.state_dict_metadata)


def _load_failure(path: Path, cause: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"cannot load the DCP checkpoint {path} ({cause}); to check its files against its manifest: "
        f"python -m pipeline.status {_run_dir_of(path)} --verify"
    )


def _run_dir_of(path: Path) -> Path:
    """The dir ``status`` takes for a step dir (``<dir>/checkpoints/step_N`` -> ``<dir>``)."""
    path = Path(path)
    return path.parent.parent if path.parent.name == "checkpoints" else path
