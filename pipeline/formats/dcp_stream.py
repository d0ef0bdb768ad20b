"""Stream a DCP checkpoint's tensors one at a time with memory bounded by the largest chunk.

Three paths, chosen per tensor from the metadata:

* **raw copy** (the common case: DDP writes each tensor as one chunk, FSDP2 shards on dim 0): every
  stored chunk spans full rows and the chunks tile dim 0, so in row-major order they are consecutive byte
  ranges of the whole tensor. Each chunk's record (a ``torch.save`` zip inside the data file) is located with
  the restricted lazy reader (:mod:`pipeline.formats.torch_zip`: only its small ``data.pkl`` is parsed), and
  its bytes are copied into the output's planned offset with ``os.copy_file_range``: no decode, no tensor in
  this process's memory, at the speed of a file copy.
* **row blocks** that are not plain contiguous records: each chunk is loaded alone
  (``torch.load(weights_only=True)`` on its byte range, as DCP itself reads it) and handed on.
* **anything else** (sharding on another dim, storage transforms): the tensor is assembled by ``dcp.load``
  into one reused buffer sized to the largest tensor.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, cast

import torch

from pipeline.errors import CheckpointFormatError, PipelineError
from pipeline.formats import dcp_metadata as dcp_meta
from pipeline.formats.dcp_metadata import _StorageInfo, read_metadata_safe, tensor_entries
from pipeline.formats.pickle_safety import error_summary
from pipeline.formats.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from pipeline.formats.torch_zip import FileWindow, LazyTensor, load_archive, open_archive
from pipeline.storage.integrity import safe_join


def _nbytes(meta: dcp_meta.TensorStorageMetadata) -> int:
    return math.prod(meta.size) * meta.properties.torch_dtype().itemsize


def _check_no_overlap(path: Path, key: str, meta: dcp_meta.TensorStorageMetadata) -> None:
    """No two chunks of ``key`` overlap: with the element count checked by ``read_metadata_safe``, the chunks
    then tile the tensor exactly, so the assembled buffer has no unwritten hole. Pairwise, as DCP checks it
    when saving (chunks are few: one per rank holding a shard)."""
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks if math.prod(c.sizes)]
    for (o1, s1), (o2, s2) in itertools.combinations(boxes, 2):
        if all(a < b + m and b < a + n for a, n, b, m in zip(o1, s1, o2, s2, strict=True)):
            raise CheckpointFormatError(
                f"{path}/.metadata: chunks of tensor {key!r} at {list(o1)} and {list(o2)} overlap "
                "(restore the step from an intact copy)"
            )


class TensorStreamer:
    """Tensors under ``prefix`` of the DCP checkpoint at ``path``, one at a time (metadata parsed once)."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.path = path
        self.metadata = read_metadata_safe(path)
        self.entries = list(tensor_entries(self.metadata, prefix))
        self._storage = {
            (idx.fqn, tuple(idx.offset)): info
            for idx, info in self.metadata.storage_data.items()
            if idx.offset is not None  # non-tensor (bytes) entries have no offset
        }
        self._buffer: torch.Tensor | None = None
        # read_metadata_safe checked that stored byte ranges lie in the data files without overlapping, so an
        # uncompressed tensor can never need more than the files hold; anything else would be a memory bomb.
        limit = sum(os.stat(safe_join(path, rel)).st_size for rel in {i.relative_path for i in self._storage.values()})
        for key, meta in self.entries:
            if _nbytes(meta) > limit:
                raise CheckpointFormatError(
                    f"{path}/.metadata: tensor {key!r} needs {_nbytes(meta)} bytes but the checkpoint's data files "
                    f"hold {limit}: the metadata does not describe these files (restore the step from an intact copy)"
                )

    def row_blocks(
        self, key: str, meta: dcp_meta.TensorStorageMetadata
    ) -> list[tuple[dcp_meta.ChunkStorageMetadata, _StorageInfo]] | None:
        """The chunks of ``key`` in row order when they are full-row blocks tiling dim 0, else None."""
        full = tuple(meta.size)
        blocks = []
        for chunk in meta.chunks:
            info = self._storage.get((key, tuple(chunk.offsets)))
            if info is None or info.transform_descriptors:
                return None
            if tuple(chunk.offsets[1:]) != (0,) * (len(full) - 1) or tuple(chunk.sizes[1:]) != full[1:]:
                return None
            blocks.append((chunk, info))
        if not full:
            return blocks if len(blocks) == 1 else None
        blocks.sort(key=lambda b: b[0].offsets[0])
        row = 0
        for chunk, _ in blocks:
            if chunk.offsets[0] != row:
                return None
            row += chunk.sizes[0]
        return blocks if row == full[0] else None

    def iter_row_blocks(
        self, meta: dcp_meta.TensorStorageMetadata, blocks: list[tuple[dcp_meta.ChunkStorageMetadata, _StorageInfo]]
    ) -> Iterator[torch.Tensor]:
        """Load each block alone, in order."""
        for chunk, info in blocks:
            tensor = self._load_chunk(info)
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != meta.properties.torch_dtype():
                raise CheckpointFormatError(
                    f"{self.path}/{info.relative_path}: chunk is not a {meta.properties.torch_dtype()} tensor"
                )
            if tuple(tensor.shape) != tuple(chunk.sizes):
                raise CheckpointFormatError(
                    f"{self.path}/{info.relative_path}: chunk shape {tuple(tensor.shape)} != {tuple(chunk.sizes)}"
                )
            yield tensor
            del tensor

    def raw_spans(
        self, meta: dcp_meta.TensorStorageMetadata, blocks: list[tuple[dcp_meta.ChunkStorageMetadata, _StorageInfo]]
    ) -> list[tuple[Path, int, int]] | None:
        """Where each row block's bytes lie as stored, ``(file, offset, length)`` in row order, so they can be
        copied without decoding; None when a block is not a plain contiguous tensor record of the expected dtype
        and shape (then the caller decodes it). Each record's ``data.pkl`` is read with the restricted, lazy
        torch.save reader (nothing is unpickled beyond tensor rebuilds; bounds are checked against the record)."""
        spans = []
        for chunk, info in blocks:
            try:
                archive = open_archive(safe_join(self.path, info.relative_path), info.offset, info.length)
                try:
                    tensor = load_archive(archive)
                finally:
                    archive.close()
            except CheckpointFormatError:
                return None  # not what this fast path reads: the decoding path reports what is wrong
            if (
                not isinstance(tensor, LazyTensor)
                or tensor.dtype != meta.properties.torch_dtype()
                or tensor.shape != tuple(chunk.sizes)
                or not tensor.is_contiguous()
            ):
                return None
            start = tensor.storage.data_offset + tensor.storage_offset * tensor.dtype.itemsize
            spans.append((tensor.path, start, tensor.nbytes))
        return spans

    def _load_chunk(self, info: _StorageInfo) -> object:
        """``torch.load(weights_only=True)`` of one stored item; any failure on damaged bytes is typed."""
        where = f"{self.path}/{info.relative_path} bytes {info.offset}..{info.offset + info.length}"
        try:
            with open(safe_join(self.path, info.relative_path), "rb") as f:
                stream = cast(IO[bytes], FileWindow(f, info.offset, info.offset + info.length))
                return torch.load(stream, map_location="cpu", weights_only=True)
        except PipelineError:
            raise
        except Exception as e:  # torch.load on damaged bytes fails in many ways (EOFError, RuntimeError, ...)
            raise CheckpointFormatError(
                f"{where}: not a readable tensor ({type(e).__name__}: {error_summary(e)}); "
                "the data file is damaged: restore the step from an intact copy"
            ) from None

    def load(self, key: str, meta: dcp_meta.TensorStorageMetadata) -> torch.Tensor:
        """The whole tensor ``key`` (general path); valid until the next call (it lives in a reused buffer)."""
        _check_no_overlap(self.path, key, meta)
        if self._buffer is None:
            self._buffer = torch.empty(max(_nbytes(m) for _, m in self.entries), dtype=torch.uint8)
        out = self._buffer[: _nbytes(meta)].view(meta.properties.torch_dtype()).view(meta.size)
        from pipeline.formats.dcp import load_into  # noqa: PLC0415 - torch's DCP package, only for this path

        load_into({key: out}, self.path, no_dist=True, metadata=self.metadata)
        return out


MODEL_PREFIX = "model."


def consolidate_dcp(step_dir: Path, out: Path, on_tensor: Callable[[str], None] | None = None) -> int:
    """Stream every ``model.`` tensor of a DCP checkpoint into one safetensors file; return the tensor count."""
    streamer = TensorStreamer(step_dir, MODEL_PREFIX)
    if not streamer.entries:
        raise PipelineError(
            f"{step_dir} holds no tensors under '{MODEL_PREFIX}': not a training checkpoint of this pipeline"
        )
    specs = [TensorSpec(k[len(MODEL_PREFIX) :], m.properties.torch_dtype(), tuple(m.size)) for k, m in streamer.entries]
    writer = StreamingSafetensorsWriter(out, specs, metadata={"format": "pt"})
    files = _OpenFiles()
    try:
        _write_all(streamer, specs, writer, files, on_tensor)
        writer.close()
    finally:
        writer.discard()  # pending copies are waited for before their source descriptors close
        files.close()
    return len(specs)


class _OpenFiles:
    """Read-only descriptors of a step's data files, opened once each (never following a symlink)."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def spans(self, spans: list[tuple[Path, int, int]]) -> Iterator[tuple[int, int, int]]:
        for path, offset, length in spans:
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            yield self.fds[path], offset, length

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _write_all(
    streamer: TensorStreamer,
    specs: list[TensorSpec],
    writer: StreamingSafetensorsWriter,
    files: _OpenFiles,
    on_tensor: Callable[[str], None] | None,
) -> None:
    for spec, (key, meta) in zip(specs, streamer.entries, strict=True):
        blocks = streamer.row_blocks(key, meta)
        spans = streamer.raw_spans(meta, blocks) if blocks is not None else None
        if spans is not None:
            writer.copy_parts(spec.name, files.spans(spans))
        elif blocks is not None:
            writer.write_parts(spec.name, streamer.iter_row_blocks(meta, blocks))
        else:
            writer.write(spec.name, streamer.load(key, meta))
        if on_tensor is not None:
            on_tensor(spec.name)
