"""Torch's value types in DCP ``.metadata`` (a shape, a dtype, a layout, a memory format), as stand-ins that
need no ``import torch``: what :mod:`pipeline.formats.dcp_metadata`'s restricted unpickler resolves them to.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

DTYPES = frozenset(
    "bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 complex32 "  # noqa: SIM905
    "complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
    "float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 long qint32 "
    "qint8 quint2x4 quint4x2 quint8 short uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8".split()
)
"""The names of torch's dtypes (``torch.<name>``), as a pickled dtype names itself (torch 2.13's, checked
against torch's own by the tests)."""
MEMORY_FORMATS = frozenset(
    ("channels_last", "channels_last_3d", "contiguous_format", "legacy_contiguous_format", "preserve_format")
)


class Size(tuple[int, ...]):
    """Stands for ``torch.Size`` (pickled as ``torch.Size((dims,))``): a tuple."""

    __slots__ = ()


@dataclass(frozen=True)
class TorchName:
    """Stands for a torch dtype, layout or memory format, by its name (``float32``, ``strided``)."""

    kind: str
    name: str

    def resolve(self) -> Any:
        import torch  # noqa: PLC0415 - only where tensors are built

        return getattr(torch, self.name)


STRIDED = TorchName("layout", "strided")


def layout(name: object) -> TorchName:
    """Stands for ``torch.serialization._get_layout``, which DCP's pickle calls with ``"torch.strided"`` (any
    other layout is refused where the tensor is checked)."""
    if not isinstance(name, str):
        raise pickle.UnpicklingError(f"layout name {name!r} is not a string")
    return TorchName("layout", name.removeprefix("torch."))
