"""The restricted unpickler of a ``torch.save`` archive's ``data.pkl``: an allow-list of globals (containers,
``torch.Size``, dtypes, tensor rebuilds as :class:`~pipeline.formats.torch_zip_archive.LazyTensor`), a few
DeepSpeed classes turned into inert data (:class:`FragmentAddress`, :class:`LossScalerState`), and every other
global refused by name unless full unpickling is asked for.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pipeline.errors import CheckpointFormatError
from pipeline.formats.pickle_safety import check_opcodes, error_summary
from pipeline.formats.torch_zip_archive import LazyTensor, Storage, TorchArchive

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
        self.storages: dict[str, Storage] = {}
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

    def persistent_load(self, pid: Any) -> Storage:
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
        storage = Storage(self.archive, key, stype.dtype, numel, record.data_offset)
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
        if not isinstance(storage, Storage) or type(storage_offset) is not int or storage_offset < 0:
            raise pickle.UnpicklingError("_rebuild_tensor_v2 without a storage and an offset")
        if shape is None or strides is None or len(shape) != len(strides):
            raise pickle.UnpicklingError("_rebuild_tensor_v2 with a malformed size or stride")
        if metadata:
            raise pickle.UnpicklingError("tensor metadata (conjugate/negative bits) is not supported")
        tensor = LazyTensor(storage, storage_offset, shape, strides)
        if storage_offset + tensor.span() > storage.numel:
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


def _opcode_refusal(file: Path, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{file}: {problem}; its data.pkl is not read safely (not a torch.save file)")


def unpickle(data: bytes, archive: TorchArchive, allow_pickle: bool = False) -> Any:
    """The object tree of ``archive``'s ``data.pkl`` (its bytes: ``data``), tensors as :class:`LazyTensor`: the
    opcodes are checked first, then the restricted unpickler runs.

    ``allow_pickle``: globals outside the allow-list are imported and called (full unpickling: only for a file
    you trust); tensors are still read lazily."""
    path = archive.path
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
