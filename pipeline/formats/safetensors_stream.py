"""Write a safetensors file one tensor at a time.

The header (names, dtypes, shapes, offsets) is computed up front from the tensor specs, so memory holds one
tensor at a time, never the model; stored bytes are copied file to file at their planned offsets
(``copy_file_range``, several ranges at once). The output is the standard format: 8-byte little-endian header length,
JSON header (space-padded to 8 bytes), then the tensors' bytes in header order.
"""

from __future__ import annotations

import collections
import errno
import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
COPY_THREADS = 4
"""Byte ranges copied at once (each to its own output offset): parallel streams help fast disks; on a slow one
they cost nothing (no buffers: ``copy_file_range`` copies in the kernel)."""


def _copy_range(src: int, offset: int, length: int, dst: int, dst_offset: int) -> None:
    """Copy ``length`` bytes at ``offset`` of ``src`` to ``dst_offset`` of ``dst``, kernel to kernel."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, min(length - done, _COPY_CHUNK), offset + done, dst_offset + done)
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
            _pwrite_all(dst, view[:n], dst_offset + done)
            done += n


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(f"write at byte {offset} made no progress")
        data, offset = data[n:], offset + n


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
    are counted I/O operations (:func:`pipeline.storage.faults.io_op`), numbered in call order whichever thread
    does the copy. A writer that failed is closed and not used again; :meth:`discard` (also after success)
    waits for pending copies, so the source descriptors may be closed after it returns.
    """

    def __init__(self, path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self.specs = list(specs)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = metadata
        offset = 0
        offsets = []
        for s in self.specs:
            if s.dtype not in DTYPES:
                raise CheckpointFormatError(f"tensor {s.name}: dtype {s.dtype} has no safetensors code")
            header[s.name] = {
                "dtype": DTYPES[s.dtype],
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            offsets.append(offset)
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._starts = [8 + len(raw) + o for o in offsets]
        io_op("create", path)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._next = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: collections.deque[Future[None]] = collections.deque()
        self._put(struct.pack("<Q", len(raw)) + raw, 0)

    def _put(self, data: bytes | memoryview, offset: int) -> None:
        if self._fd is None:
            raise CheckpointFormatError(f"{self.path}: the writer was closed after an error")
        try:
            io_op("write", self.path)
            _pwrite_all(self._fd, memoryview(data).cast("B"), offset)
        except BaseException:
            self.discard()
            raise

    def copy_parts(self, name: str, spans: Iterable[tuple[int, int, int]]) -> None:
        """Write the next planned tensor from raw byte ranges ``(fd, offset, length)`` of other files, in order,
        without reading them into this process (``os.copy_file_range``, up to :data:`COPY_THREADS` ranges at
        once, each to its planned output offset; a plain read/write loop where the filesystem refuses it). The
        caller has checked that the ranges hold the tensor's bytes as stored, and keeps the descriptors open
        until :meth:`close` or :meth:`discard` returns."""
        spec = self._expect(name)
        at = self._starts[self._next]
        written = 0
        for fd, offset, length in spans:
            if written + length > spec.nbytes:
                written += length
                break
            try:
                io_op("write", self.path)
                self._submit(fd, offset, length, at + written)
            except BaseException:
                self.discard()
                raise
            written += length
        if written != spec.nbytes:
            self.discard()
            raise CheckpointFormatError(
                f"{self.path}: {name} got {written} bytes from its parts, planned {spec.nbytes}"
            )
        self._next += 1

    def _submit(self, src: int, offset: int, length: int, dst_offset: int) -> None:
        if self._fd is None:
            raise CheckpointFormatError(f"{self.path}: the writer was closed after an error")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="safetensors-copy")
        while len(self._pending) >= 2 * COPY_THREADS or (self._pending and self._pending[0].done()):
            self._pending.popleft().result()  # a copy's error, raised in submission order
        self._pending.append(self._pool.submit(_copy_range, src, offset, length, self._fd, dst_offset))

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()

    def discard(self) -> None:
        """Wait for pending copies (their errors dropped) and close the file; safe to call more than once."""
        for fut in self._pending:
            fut.exception()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def write_parts(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Write the next planned tensor from consecutive row-major pieces (e.g. dim-0 shards, in order)."""
        spec = self._expect(name)
        at = self._starts[self._next]
        written = 0
        for part in parts:
            if part.dtype != spec.dtype:
                self.discard()
                raise CheckpointFormatError(f"{self.path}: part of {name} is {part.dtype}, planned {spec.dtype}")
            flat = part.detach().contiguous().reshape(-1).view(torch.uint8)
            if written + flat.numel() > spec.nbytes:
                self.discard()
                raise CheckpointFormatError(f"{self.path}: the parts of {name} hold more than its {spec.nbytes} bytes")
            self._put(flat.numpy().data, at + written)
            written += flat.numel()
        if written != spec.nbytes:
            self.discard()
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
        self._put(flat.numpy().data, self._starts[self._next])
        self._next += 1

    def close(self) -> None:
        """Wait for every copy, check that every planned tensor was written, fsync and close."""
        if self._fd is None:
            raise CheckpointFormatError(f"{self.path}: the writer was closed after an error")
        try:
            while self._pending:
                self._pending.popleft().result()
            if self._next != len(self.specs):
                raise CheckpointFormatError(f"{self.path}: only {self._next} of {len(self.specs)} tensors were written")
            io_op("fsync", self.path)
            os.fsync(self._fd)
        finally:
            self.discard()
