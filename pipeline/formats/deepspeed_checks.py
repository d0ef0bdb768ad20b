"""The checks every value read from a DeepSpeed ZeRO file goes through, and the one error naming a malformed file.

Each check returns the value when it has the expected kind and raises :func:`malformed`'s
:class:`~pipeline.errors.CheckpointFormatError` otherwise.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import CheckpointFormatError
from pipeline.formats.torch_zip import LazyTensor


def malformed(where: object, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{where}: {problem}; it is not a DeepSpeed ZeRO checkpoint this pipeline reads "
        "(restore the step from an intact copy or save it again)"
    )


def require_field(d: object, key: str, kind: type | tuple[type, ...], where: object) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise malformed(where, f"the field {key!r} is missing")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and type(value) is bool):
        raise malformed(where, f"the field {key!r} is a {type(value).__name__}")
    return value


def as_shape(value: object, where: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(d) is int and d >= 0 for d in value):
        raise malformed(where, f"a shape {str(value)[:60]} is not a list of sizes")
    return tuple(value)


def as_flat(value: object, where: object) -> LazyTensor:
    if not isinstance(value, LazyTensor) or len(value.shape) != 1 or not value.is_contiguous():
        raise malformed(where, f"expected a flat (1-D contiguous) tensor, found {type(value).__name__}")
    return value


def as_shapes(d: object, where: object) -> dict[str, tuple[int, ...]]:
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise malformed(where, "a name -> shape mapping is malformed")
    return {k: as_shape(v, f"{where} [{k}]") for k, v in d.items()}
