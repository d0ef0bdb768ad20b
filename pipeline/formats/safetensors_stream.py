"""Write a safetensors file one tensor at a time.

The header (names, dtypes, shapes, offsets) is computed up front from the tensor specs, so memory holds one
tensor at a time, never the model. The output is the standard format: 8-byte little-endian header length,
JSON header (space-padded to 8 bytes), then the tensors' bytes in header order.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import CheckpointFormatError
from pipeline.storage.faults import io_op

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


_COPY_CHUNK = 1 << 30


def _copy_range(src: int, offset: int, length: int, dst: int) -> None:
    """Append ``length`` bytes at ``offset`` of ``src`` to ``dst`` (at its current offset), kernel to kernel."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, min(length - done, _COPY_CHUNK), offset + done)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            break  # e.g. across filesystems on an old kernel: copy through a small buffer
        if n == 0:
            raise OSError(f"source ended at byte {offset + done} while copying {length} bytes (file shrank?)")
        done += n
    if done < length:
        buf = bytearray(min(length - done, 8 << 20))
        view = memoryview(buf)
        while done < length:
            n = os.preadv(src, [view[: min(len(buf), length - done)]], offset + done)
            if n == 0:
                raise OSError(f"source ended at byte {offset + done} while copying {length} bytes (file shrank?)")
            chunk = view[:n]
            while chunk:
                chunk = chunk[os.write(dst, chunk) :]
            done += n


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class StreamingSafetensorsWriter:
    """``write`` tensors in the order of ``specs``; ``close`` checks that all were written and fsyncs.

    The file is written under its final name, so ``path`` must lie in a staging directory that is published
    by one rename once complete (:func:`pipeline.storage.atomic.publish_dir`). Every data write and the fsync
    are counted I/O operations (:func:`pipeline.storage.faults.io_op`).
    """

    def __init__(self, path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self.specs = list(specs)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = metadata
        offset = 0
        for s in self.specs:
            if s.dtype not in DTYPES:
                raise CheckpointFormatError(f"tensor {s.name}: dtype {s.dtype} has no safetensors code")
            header[s.name] = {
                "dtype": DTYPES[s.dtype],
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        io_op("create", path)
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close(); unbuffered: data is
        self._next = 0  # written in large pieces, and copy_file_range writes at the file's own offset
        self._put(struct.pack("<Q", len(raw)) + raw)

    def _put(self, data: bytes | memoryview) -> None:
        try:
            io_op("write", self.path)
            view = memoryview(data).cast("B")
            while view:
                n = self._file.write(view)
                if not n:
                    raise OSError(f"{self.path}: write made no progress")
                view = view[n:]
        except BaseException:
            self._file.close()  # a failed write ends the file: the writer is not used again
            raise

    def copy_parts(self, name: str, spans: Iterable[tuple[int, int, int]]) -> None:
        """Write the next planned tensor from raw byte ranges ``(fd, offset, length)`` of other files, in order,
        without reading them into this process (``os.copy_file_range``; a plain read/write loop where the
        filesystem refuses it). The caller has checked that the ranges hold the tensor's bytes as stored."""
        spec = self._expect(name)
        written = 0
        for fd, offset, length in spans:
            try:
                io_op("write", self.path)
                _copy_range(fd, offset, length, self._file.fileno())
            except BaseException:
                self._file.close()
                raise
            written += length
        if written != spec.nbytes:
            raise CheckpointFormatError(
                f"{self.path}: {name} got {written} bytes from its parts, planned {spec.nbytes}"
            )
        self._next += 1

    def write_parts(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Write the next planned tensor from consecutive row-major pieces (e.g. dim-0 shards, in order)."""
        spec = self._expect(name)
        written = 0
        for part in parts:
            if part.dtype != spec.dtype:
                raise CheckpointFormatError(f"{self.path}: part of {name} is {part.dtype}, planned {spec.dtype}")
            flat = part.detach().contiguous().reshape(-1).view(torch.uint8)
            self._put(flat.numpy().data)
            written += flat.numel()
        if written != spec.nbytes:
            raise CheckpointFormatError(
                f"{self.path}: {name} got {written} bytes from its parts, planned {spec.nbytes}"
            )
        self._next += 1

    def _expect(self, name: str) -> TensorSpec:
        if self._next >= len(self.specs):
            raise CheckpointFormatError(f"{self.path}: tensor {name} was not planned")
        spec = self.specs[self._next]
        if name != spec.name:
            raise CheckpointFormatError(f"{self.path}: expected tensor {spec.name} next, got {name}")
        return spec

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._expect(name)
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise CheckpointFormatError(
                f"{self.path}: expected {spec.name} {spec.dtype} {spec.shape}, "
                f"got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._put(flat.numpy().data)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.specs):
            self._file.close()
            raise CheckpointFormatError(f"{self.path}: only {self._next} of {len(self.specs)} tensors were written")
        try:
            io_op("fsync", self.path)
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
