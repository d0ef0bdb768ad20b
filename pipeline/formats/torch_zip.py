"""Safe, lazy reader of ``torch.save`` zip archives (e.g. DeepSpeed checkpoints), without unpickling code.

Input: a file written by ``torch.save`` (zip format: ``<archive>/data.pkl`` plus one uncompressed record
``<archive>/data/<key>`` per storage).
Output: :func:`load_lazy` returns the saved object tree: plain containers and scalars, ``OrderedDict``,
``torch.Size``, dtypes, and a :class:`LazyTensor` for every tensor, which reads only the bytes asked for
(``os.pread`` at the storage record's offset, found from the zip local header). A few DeepSpeed classes become
inert data: ``ZeroStageEnum`` its int value, ``fragment_address`` a :class:`FragmentAddress`, ``LossScaler`` a
:class:`LossScalerState` holding its attributes.

``data.pkl`` is read with a restricted unpickler: its opcodes are checked first (memo and frame bombs), and a
global outside the allow-list is refused with a :class:`~pipeline.errors.CheckpointFormatError` naming it
(nothing is imported or called). Compressed or encrypted records, records that run past the end of the file,
storages smaller than their tensors and a ``data.pkl`` over 256 MiB are refused too.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import stat
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch

from pipeline.errors import CheckpointFormatError, PipelineError
from pipeline.formats.pickle_safety import check_opcodes, error_summary

MAX_PICKLE_BYTES = 256 << 20
"""Largest ``data.pkl`` read (DeepSpeed's are kilobytes to a few megabytes: tensors live in the records)."""

ALLOW_PICKLE_HINT = "set import.allow_pickle=true to opt in to full unpickling for a file you trust"

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
    "UntypedStorage": torch.uint8,
}

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader: 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"


class FragmentAddress(NamedTuple):
    """DeepSpeed's ``deepspeed.utils.tensor_fragment.fragment_address`` as inert data."""

    numel: int
    start: int


@dataclass
class LossScalerState:
    """A DeepSpeed loss scaler (``LossScaler``/``DynamicLossScaler``) as inert data: its class name and attributes."""

    cls: str = ""
    state: dict[str, Any] = field(default_factory=dict)


class _Refused(Exception):
    """A global outside the allow-list (raised inside the unpickler, turned into a CheckpointFormatError)."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module = module
        self.name = name


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
class _Storage:
    archive: TorchArchive
    key: str
    dtype: torch.dtype
    numel: int
    data_offset: int


@dataclass(frozen=True)
class LazyTensor:
    """A tensor in a ``torch.save`` archive: metadata only until :meth:`read` or :meth:`materialize`."""

    storage: _Storage
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

    def _span(self) -> int:
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
        span = self._read_storage(self.storage_offset, self._span())
        return span.as_strided(self.shape, self.stride).contiguous()


class _StorageType(NamedTuple):
    dtype: torch.dtype


class _TensorType(NamedTuple):
    name: str


def _nonneg_ints(value: object) -> tuple[int, ...] | None:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        return None
    return tuple(value)


class _Stub:
    """Stands in for an allow-listed DeepSpeed class while unpickling (NEWOBJ + BUILD); replaced afterwards."""

    kind = ""

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:  # the (None, slotstate) form
            state = state[1]
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"the state of a {self.kind} is not a dict")
        self.state = state


class _FragmentAddressStub(_Stub):
    kind = "fragment_address"


class _LossScalerStub(_Stub):
    kind = "LossScaler"


class _DynamicLossScalerStub(_Stub):
    kind = "DynamicLossScaler"


_DS_STUBS: dict[tuple[str, str], type[_Stub]] = {
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _FragmentAddressStub,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _LossScalerStub,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _DynamicLossScalerStub,
}
_TORCH_DTYPES: dict[str, torch.dtype] = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _zero_stage(value: object) -> int:
    if type(value) is not int or not 0 <= value <= 3:
        raise pickle.UnpicklingError(f"ZeroStageEnum({value!r}) is not a ZeRO stage")
    return value


def _codecs_encode(text: object, encoding: object = "utf-8") -> bytes:
    """Protocol-2 pickles write ``bytes`` as ``_codecs.encode(str, 'latin1')``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is allowed only as protocol 2 writes bytes")
    return text.encode("latin1")


class _LazyUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: TorchArchive, allow_pickle: bool = False) -> None:
        super().__init__(io.BytesIO(data))
        self.archive = archive
        self.allow_pickle = allow_pickle
        self.storages: dict[str, _Storage] = {}
        self._globals: dict[tuple[str, str], object] = {
            ("builtins", "set"): set,
            ("__builtin__", "set"): set,
            ("builtins", "frozenset"): frozenset,
            ("__builtin__", "frozenset"): frozenset,
            ("_codecs", "encode"): _codecs_encode,
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch", "Size"): torch.Size,
            ("torch", "Tensor"): _TensorType("torch.Tensor"),
            ("torch.nn.parameter", "Parameter"): _TensorType("torch.nn.Parameter"),
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor_v2,
            ("torch._utils", "_rebuild_parameter"): self._rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): self._rebuild_parameter,
            ("torch._tensor", "_rebuild_from_type_v2"): self._rebuild_from_type_v2,
            ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
            **_DS_STUBS,
        }

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name in _TORCH_DTYPES:
            return _TORCH_DTYPES[name]
        if self.allow_pickle:  # opted in for a trusted file: import and call it (tensors stay lazy)
            return super().find_class(module, name)
        raise _Refused(module, name)

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"persistent id {str(pid)[:80]} is not a torch.save storage")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType) or not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"malformed storage reference {str(pid)[:80]}")
        known = self.storages.get(key)
        if known is not None:
            if known.dtype != stype.dtype or known.numel != numel:
                raise pickle.UnpicklingError(f"storage {key} is referenced with two dtypes or sizes")
            return known
        record = self.archive.records.get(f"data/{key}")
        if record is None:
            raise pickle.UnpicklingError(f"storage record data/{key} is missing")
        if record.size < numel * stype.dtype.itemsize:
            raise pickle.UnpicklingError(
                f"storage record data/{key} has {record.size} bytes, fewer than its {numel} {stype.dtype} elements"
            )
        storage = _Storage(self.archive, key, stype.dtype, numel, record.data_offset)
        self.storages[key] = storage
        return storage

    def _rebuild_tensor_v2(
        self,
        storage: object,
        storage_offset: object,
        size: object,
        stride: object,
        requires_grad: object = False,
        backward_hooks: object = None,
        metadata: object = None,
    ) -> LazyTensor:
        shape, strides = _nonneg_ints(size), _nonneg_ints(stride)
        if not isinstance(storage, _Storage) or type(storage_offset) is not int or storage_offset < 0:
            raise pickle.UnpicklingError("_rebuild_tensor_v2 without a storage and an offset")
        if shape is None or strides is None or len(shape) != len(strides):
            raise pickle.UnpicklingError("_rebuild_tensor_v2 with a malformed size or stride")
        if metadata:
            raise pickle.UnpicklingError("tensor metadata (conjugate/negative bits) is not supported")
        tensor = LazyTensor(storage, storage_offset, shape, strides)
        if storage_offset + tensor._span() > storage.numel:
            raise pickle.UnpicklingError(
                f"a tensor {list(shape)} at offset {storage_offset} lies outside its storage "
                f"of {storage.numel} elements"
            )
        return tensor

    def _rebuild_parameter(self, data: object, requires_grad: object, hooks: object, state: object = None) -> object:
        if not isinstance(data, LazyTensor):
            raise pickle.UnpicklingError("_rebuild_parameter without a tensor")
        return data

    def _rebuild_from_type_v2(self, func: object, new_type: object, args: object, state: object) -> object:
        if func != self._rebuild_tensor_v2 or not isinstance(new_type, _TensorType) or not isinstance(args, tuple):
            raise pickle.UnpicklingError("_rebuild_from_type_v2 is allowed only for torch.Tensor/Parameter tensors")
        rebuild: Callable[..., object] = self._rebuild_tensor_v2
        return rebuild(*args)


def _finish(obj: Any, depth: int = 0) -> Any:
    """Replace the DeepSpeed stubs by inert data (:class:`FragmentAddress`, :class:`LossScalerState`)."""
    if depth > 200:
        raise CheckpointFormatError("object tree nested deeper than 200 levels")
    if isinstance(obj, _Stub):
        st = getattr(obj, "state", None)
        if not isinstance(st, dict):
            raise CheckpointFormatError(f"a {obj.kind} without state")
        if isinstance(obj, _FragmentAddressStub):
            if not (type(st.get("numel")) is int and type(st.get("start")) is int):
                raise CheckpointFormatError("a fragment_address without integer numel and start")
            return FragmentAddress(st["numel"], st["start"])
        return LossScalerState(obj.kind, {k: _finish(v, depth + 1) for k, v in st.items()})
    if isinstance(obj, dict):
        for k in list(obj):
            obj[k] = _finish(obj[k], depth + 1)
        return obj
    if isinstance(obj, list):
        obj[:] = [_finish(v, depth + 1) for v in obj]
        return obj
    if type(obj) is tuple:
        return tuple(_finish(v, depth + 1) for v in obj)
    return obj


def open_archive(path: Path, start: int = 0, length: int | None = None) -> TorchArchive:
    """Open ``path`` (or its bytes ``start..start+length``) as a torch.save zip archive (records located;
    nothing unpickled)."""
    return TorchArchive(path, start, length)


def _opcode_refusal(file: Path, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{file}: {problem}; its data.pkl is not read safely (not a torch.save file)")


def load_archive(archive: TorchArchive, allow_pickle: bool = False) -> Any:
    """The object tree of an open archive, tensors as :class:`LazyTensor` (see the module docstring).

    ``allow_pickle``: globals outside the allow-list are imported and called (full unpickling: only for a file
    you trust); tensors are still read lazily."""
    path = archive.path
    data = archive.read_record("data.pkl", MAX_PICKLE_BYTES)
    check_opcodes(data, path, _opcode_refusal)
    unpickler = _LazyUnpickler(data, archive, allow_pickle)
    try:
        obj = unpickler.load()
    except _Refused as e:
        raise CheckpointFormatError(
            f"{path}: its pickle references the global {e.module}.{e.name}, which this pipeline does not run; "
            f"reading it needs full unpickling ({ALLOW_PICKLE_HINT})"
        ) from None
    except RecursionError:
        raise CheckpointFormatError(f"{path}: its pickle nests too deeply to be read safely") from None
    except Exception as e:  # any other failure of the restricted unpickler on hostile bytes
        raise CheckpointFormatError(
            f"{path}: data.pkl cannot be unpickled safely ({type(e).__name__}: {error_summary(e)}); "
            "restore the file from an intact copy"
        ) from None
    return _finish(obj)


def load_lazy(path: Path, allow_pickle: bool = False) -> Any:
    """Open ``path`` and return its object tree with :class:`LazyTensor` leaves (nothing read beyond data.pkl)."""
    return load_archive(open_archive(Path(path)), allow_pickle)
