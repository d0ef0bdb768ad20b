"""An open ``torch.save`` zip archive and the tensors in it, read lazily: :class:`TorchArchive` locates each
uncompressed record from its zip local header and reads with ``os.pread``; :class:`LazyTensor` is a tensor's
metadata, reading only the bytes asked for. Nothing here unpickles (see :mod:`pipeline.formats.torch_zip`).
"""

from __future__ import annotations

import io
import math
import os
import stat
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from pipeline.errors import CheckpointFormatError, PipelineError
from pipeline.formats.pickle_safety import error_summary

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader: 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class _Record:
    name: str
    data_offset: int
    size: int


class TorchArchive:
    """An open ``torch.save`` zip: its records' data offsets, and one read-only descriptor for ``pread``.

    The descriptor is opened with ``O_NOFOLLOW`` (a symlink is refused) and reopened on demand after
    :meth:`close`; tensors read from it stay valid.
    """

    def __init__(self, path: Path, start: int = 0, length: int | None = None) -> None:
        """``start``/``length``: the archive is embedded in ``path`` at that byte range (a DCP record)."""
        self.path = Path(path)
        self._fd: int | None = None
        fd = self._open()
        file_size = os.fstat(fd).st_size
        end = file_size if length is None else start + length
        if start < 0 or end > file_size or end < start:
            self.close()
            raise CheckpointFormatError(
                f"{self.path}: bytes {start}..{end} lie outside the {file_size}-byte file (truncated?): "
                "restore it from an intact copy"
            )
        self.start = start
        size = end
        try:
            with os.fdopen(os.dup(fd), "rb") as raw, zipfile.ZipFile(FileWindow(raw, start, end)) as z:
                infos = z.infolist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error) as e:
            self.close()
            raise CheckpointFormatError(
                f"{self.path}: not a complete torch.save zip archive ({error_summary(e)}); the file may be "
                "truncated or corrupt: restore it from an intact copy or save the checkpoint again"
            ) from None
        pickles = [i.filename for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if len(pickles) != 1:
            self.close()
            raise CheckpointFormatError(
                f"{self.path}: expected exactly one '<archive>/data.pkl' record, found {len(pickles)}; "
                "this is not a torch.save file (legacy non-zip torch.save files are not read)"
            )
        self.prefix = pickles[0][: -len("data.pkl")]
        self.records: dict[str, _Record] = {}
        for info in infos:
            if info.filename.startswith(self.prefix):
                self.records[info.filename[len(self.prefix) :]] = self._locate(info, size)
        byteorder = self.records.get("byteorder")
        if byteorder is not None and self.read_record("byteorder", 16) != b"little":
            self.close()
            raise CheckpointFormatError(f"{self.path}: saved on a big-endian machine; only little-endian is read")

    def _open(self) -> int:
        if self._fd is None:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                raise CheckpointFormatError(f"{self.path} is missing") from None
            except OSError as e:
                raise CheckpointFormatError(
                    f"{self.path} cannot be opened ({e.strerror}); a symlink or an unreadable file is not read"
                ) from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise CheckpointFormatError(f"{self.path} is not a regular file")
            self._fd = fd
        return self._fd

    def fileno(self) -> int:
        """The archive file's read-only descriptor (reopened on demand after :meth:`close`)."""
        return self._open()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()

    def _locate(self, info: zipfile.ZipInfo, file_size: int) -> _Record:
        where = f"{self.path}: record {info.filename!r}"
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            raise CheckpointFormatError(f"{where} is compressed or encrypted; torch.save stores records uncompressed")
        header_offset = self.start + info.header_offset
        raw = self._pread(_LOCAL_HEADER.size, header_offset)
        if len(raw) != _LOCAL_HEADER.size or raw[:4] != _LOCAL_MAGIC:
            raise CheckpointFormatError(f"{where}: no local header at byte {header_offset} (truncated or corrupt)")
        fields = _LOCAL_HEADER.unpack(raw)
        name_len, extra_len = fields[-2], fields[-1]
        data_offset = header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if info.compress_size != info.file_size or data_offset + info.file_size > file_size:
            raise CheckpointFormatError(
                f"{where}: its {info.file_size} bytes at byte {data_offset} run past the end of the "
                f"{file_size}-byte file (truncated?): restore the file from an intact copy"
            )
        return _Record(info.filename, data_offset, info.file_size)

    def _pread(self, count: int, offset: int) -> bytes:
        return os.pread(self._open(), count, offset)

    def read_record(self, name: str, limit: int) -> bytes:
        """The bytes of record ``<prefix>/<name>``, refusing one larger than ``limit``."""
        rec = self.records.get(name)
        if rec is None:
            raise CheckpointFormatError(f"{self.path}: record {self.prefix}{name} is missing")
        if rec.size > limit:
            raise CheckpointFormatError(f"{self.path}: record {rec.name} has {rec.size} bytes, more than {limit}")
        data = self._pread(rec.size, rec.data_offset)
        if len(data) != rec.size:
            raise CheckpointFormatError(f"{self.path}: record {rec.name} is short (the file shrank while read)")
        return data

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` from absolute file ``offset`` (looping over short reads)."""
        fd, done = self._open(), 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise CheckpointFormatError(f"{self.path}: ended at byte {offset + done} while reading a tensor")
            done += n


class FileWindow(io.RawIOBase):
    """Bytes ``start..end`` of an open file as a seekable file of their own (for ``zipfile``)."""

    def __init__(self, f: IO[bytes], start: int, end: int) -> None:
        self.f, self.begin, self.end, self.pos = f, start, end, start

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos - self.begin

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self.begin, io.SEEK_CUR: self.pos, io.SEEK_END: self.end}[whence]
        self.pos = min(max(base + offset, self.begin), self.end)
        return self.pos - self.begin

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.end - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])  # type: ignore[attr-defined]
        self.pos += got
        return int(got)


@dataclass(frozen=True)
class Storage:
    """A storage record of the archive (``data/<key>``): its dtype, element count and data offset."""

    archive: TorchArchive
    key: str
    dtype: torch.dtype
    numel: int
    data_offset: int


@dataclass(frozen=True)
class LazyTensor:
    """A tensor in a ``torch.save`` archive: metadata only until :meth:`read` or :meth:`materialize`."""

    storage: Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def path(self) -> Path:
        return self.storage.archive.path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def span(self) -> int:
        """Storage elements from ``storage_offset`` that the tensor can touch."""
        if self.numel == 0:
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))

    def _read_storage(self, start: int, count: int) -> torch.Tensor:
        out = torch.empty(count, dtype=self.dtype)
        if count:
            view = out.view(torch.uint8).numpy().data
            self.storage.archive.read_into(view, self.storage.data_offset + start * self.dtype.itemsize)
        return out

    def read(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + count)`` of the flattened (row-major) tensor, as a fresh 1-D tensor.

        Only those bytes are read. The tensor must be contiguous (use :meth:`materialize` otherwise)."""
        total = self.numel
        count = total - start if count is None else count
        if start < 0 or count < 0 or start + count > total:
            raise PipelineError(f"{self.path}: read of [{start}, {start + count}) outside a tensor of {total} elements")
        if not self.is_contiguous():
            raise PipelineError(f"{self.path}: flat read of a non-contiguous tensor {self.shape}/{self.stride}")
        return self._read_storage(self.storage_offset + start, count)

    def materialize(self) -> torch.Tensor:
        """The whole tensor (any strides) as a fresh contiguous tensor."""
        if self.is_contiguous():
            return self.read().view(self.shape)
        span = self._read_storage(self.storage_offset, self.span())
        return span.as_strided(self.shape, self.stride).contiguous()
