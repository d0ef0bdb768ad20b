"""One rank's state as one self-describing blob, and back, with nothing unpickled.

A fast-tier copy holds what this rank has of the state dict (:func:`pipeline.checkpoint.save.state.save_state`'s
structure: FSDP2's DTensors as their local shards, DDP's replicated tensors whole), so it restores only at the
same world size and layout, into the same rank. A DTensor's shard records which piece of the global tensor it
is (global shape, chunk offsets and sizes), so a restore into another piece (another mesh or placements at the
same world size: dp=2, tp=2 then dp=4, tp=1) is refused even where the local shapes agree. The blob is a
safetensors file whose metadata holds the skeleton as JSON (containers, scalars, strings, bytes and where each
tensor goes): decoding parses JSON and the safetensors header, never pickle.

:func:`snapshot` is what training waits for: it lays the blob out (header first) and copies every tensor straight
into its place: in one buffer, which the next snapshot reuses, or (a CPU state's big tensors) into the node file
the caller gives for it (:mod:`.slots`), so the background has nothing left to serialise or copy.
:func:`unpack` returns tensors that are views of the buffer it is given (no copy); :func:`fill` copies them into
the tensors being restored.
"""

from __future__ import annotations

import base64
import bisect
import json
import math
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pipeline.errors import CheckpointFormatError

SKELETON_KEY = "pipeline.fast.skeleton"
"""The safetensors metadata entry that holds the skeleton."""
_HEAD = struct.Struct("<Q")
"""safetensors' own first 8 bytes: the length of its JSON header."""
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_NAMES = {v: k for k, v in DTYPES.items()}


Place = Callable[[int, int], "torch.Tensor | None"]
"""Where :func:`snapshot` puts the tensor at a blob offset, of a size in bytes (None: in its own buffer)."""
Layout = tuple[tuple[int, ...], tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]
"""A DTensor shard's place: the global shape, and each local chunk's (offsets, sizes) in it."""


@dataclass(frozen=True)
class Piece:
    """A DTensor's local shard as :func:`unpack` returns it, with its place in the global tensor."""

    tensor: torch.Tensor
    where: Layout


def _piece_of(t: DTensor) -> Layout:
    """Where this rank's shard of ``t`` lies in the global tensor, as DCP's save plan records it."""
    chunks = t.__create_chunk_list__()
    return tuple(t.shape), tuple((tuple(map(int, c.offsets)), tuple(map(int, c.sizes))) for c in chunks)


def _layout(shape: Any, chunks: Any) -> Layout:
    return tuple(map(int, shape)), tuple((tuple(map(int, o)), tuple(map(int, z))) for o, z in chunks)


@dataclass
class Blob:
    """A packed rank state: ``data`` (a uint8 CPU tensor, pinned when the state is on a GPU) is the blob, except
    the tensors ``placed`` elsewhere (by where they start: :func:`snapshot`'s ``place``); ``spans``: each tensor's
    bytes in it (start, end), in order (:mod:`.pieces` cuts the blob along them)."""

    data: torch.Tensor
    spans: tuple[tuple[int, int], ...] = ()
    placed: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def view(self) -> memoryview:
        """The blob's bytes, without a copy (where nothing is placed: else :meth:`piece`)."""
        if self.placed:
            raise ValueError("the blob's placed tensors are not in its buffer: read it piece by piece")
        return self.data.numpy().data.cast("B")

    def piece(self, b: int, e: int) -> torch.Tensor:
        """Bytes ``b``..``e`` (a placed tensor whole, or a range of the buffer), no copy."""
        placed = self.placed.get(b)
        if placed is not None and placed.numel() == e - b:
            return placed
        return self.data[b:e]

    def bytes(self, b: int, e: int) -> memoryview:
        return self.piece(b, e).numpy().data.cast("B")


def snapshot(state: Any, reuse: Blob | None = None, place: Place | None = None) -> Blob:
    """``state`` packed into one CPU buffer (a DTensor: its local shard), so training may go on. ``reuse``: the
    previous snapshot's buffer, overwritten when the blob has the same size (nothing may still read it).
    ``place(start, size)``: where a CPU state's tensor that starts at ``start`` in the blob goes instead of the
    buffer (a uint8 tensor of ``size`` bytes: a node file's mapping), or None (the buffer); a GPU state goes
    whole into the pinned buffer its copy from the device needs."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def walk(v: Any, where: str) -> Any:
        if isinstance(v, torch.Tensor):
            local = (v.to_local() if isinstance(v, DTensor) else v).detach()
            if local.dtype not in _NAMES:
                raise CheckpointFormatError(f"fast tier: tensor {where} is {local.dtype}, which it cannot hold")
            key = f"t{len(tensors)}"
            tensors.append((key, local))
            if isinstance(v, DTensor):
                shape, chunks = _piece_of(v)
                return {"S": [key, list(shape), [[list(o), list(z)] for o, z in chunks]]}
            return {"T": key}
        if isinstance(v, dict):
            return {"D": [[walk(k, where), walk(x, f"{where}.{k}")] for k, x in v.items()]}
        if isinstance(v, list | tuple):
            return {"L" if isinstance(v, list) else "U": [walk(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, bytes):
            return {"B": base64.b64encode(v).decode()}
        if v is None or isinstance(v, bool | int | float | str):
            return {"V": v}
        raise CheckpointFormatError(
            f"fast tier: state value {where or '<root>'} is a {type(v).__name__}; it holds tensors, containers, "
            "numbers, strings and bytes only (give the object a state_dict of those)"
        )

    skeleton = walk(state, "")
    # safetensors' order: wider elements first, so every tensor starts aligned to its element size
    tensors.sort(key=lambda kt: (-kt[1].element_size(), int(kt[0][1:])))
    header: dict[str, Any] = {"__metadata__": {SKELETON_KEY: json.dumps(skeleton, separators=(",", ":"))}}
    offset = 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = _HEAD.size + len(raw)
    total = start + offset
    gpu = any(t.is_cuda for _, t in tensors)
    if reuse is not None and reuse.nbytes == total and reuse.data.is_pinned() == gpu:
        buf = reuse.data
    else:
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=gpu)
    buf[:start].copy_(torch.frombuffer(bytearray(_HEAD.pack(len(raw)) + raw), dtype=torch.uint8))
    placed: dict[int, torch.Tensor] = {}
    for key, t in tensors:
        b, e = (start + x for x in header[key]["data_offsets"])
        if e > b:
            dest = place(b, e - b) if place is not None and not gpu else None
            if dest is None:
                dest = buf[b:e]
            else:
                placed[b] = dest
            dest.view(t.dtype).view(t.shape).copy_(t, non_blocking=gpu)
    if gpu:
        torch.cuda.synchronize()
    spans = sorted((start + b, start + e) for b, e in (header[k]["data_offsets"] for k, _ in tensors) if e > b)
    return Blob(buf, tuple(spans), placed)


@dataclass(frozen=True)
class Scattered:
    """A blob whose pieces lie in separate buffers (a restore's mapped files and received bytes): ``views[i]``
    holds the blob's bytes from ``starts[i]``, one after another, ``size`` in all."""

    starts: tuple[int, ...]
    views: tuple[memoryview, ...]
    size: int

    def __len__(self) -> int:
        return self.size

    def at(self, b: int, e: int) -> tuple[memoryview, int]:
        """The buffer holding bytes ``b``..``e`` whole, and where they start in it (ValueError: none does)."""
        i = bisect.bisect_right(self.starts, b) - 1
        if i < 0 or e - self.starts[i] > len(self.views[i]):
            raise ValueError(f"bytes {b}..{e} do not lie in one piece")
        return self.views[i], b - self.starts[i]


BlobView = memoryview | Scattered
"""What a restore hands to :func:`unpack`: one buffer, or the pieces of one."""


def unpack(blob: Any, what: str) -> Any:
    """The state a blob (any buffer, or :class:`Scattered` pieces) holds; its tensors are views of the blob's
    buffers (CPU, no copy). ``what`` names it in errors."""
    pieces = blob if isinstance(blob, Scattered) else None
    view = pieces.views[0] if pieces is not None else memoryview(blob).cast("B")
    try:
        (n,) = _HEAD.unpack_from(view)
        if n > len(view) - _HEAD.size:
            raise ValueError(f"header of {n} bytes in {len(view)}")
        header = json.loads(bytes(view[_HEAD.size : _HEAD.size + n]))
        skeleton = json.loads(header.pop("__metadata__")[SKELETON_KEY])
        whole = pieces or Scattered((0,), (view,), len(view))
        tensors = _tensors(whole, _HEAD.size + n, header)
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise CheckpointFormatError(f"{what}: not a readable fast-tier copy ({e})") from e

    def build(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise CheckpointFormatError(f"{what}: malformed skeleton node {str(node)[:80]}")
        ((tag, value),) = node.items()
        if tag == "T":
            if value not in tensors:
                raise CheckpointFormatError(f"{what}: skeleton names tensor {value!r} the copy lacks")
            return tensors[value]
        if tag == "S":
            try:
                key, shape, chunks = value
                where = _layout(shape, chunks)
            except (ValueError, TypeError) as e:
                raise CheckpointFormatError(f"{what}: malformed skeleton node {str(node)[:80]}") from e
            if not isinstance(key, str):
                raise CheckpointFormatError(f"{what}: malformed skeleton node {str(node)[:80]}")
            return Piece(build({"T": key}), where)
        if tag == "D":
            return {build(k): build(x) for k, x in value}
        if tag in ("L", "U"):
            items = [build(x) for x in value]
            return items if tag == "L" else tuple(items)
        if tag == "B":
            return base64.b64decode(value)
        if tag == "V":
            return value
        raise CheckpointFormatError(f"{what}: unknown skeleton tag {tag!r}")

    return build(skeleton)


def _tensors(blob: Scattered, start: int, header: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The header's tensors as views of the blob's buffers; every entry checked against them (ValueError)."""
    out: dict[str, torch.Tensor] = {}
    size = blob.size - start
    for key, entry in header.items():
        dtype = DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        b, e = (int(x) for x in entry["data_offsets"])
        item = torch.empty(0, dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= b <= e <= size or e - b != math.prod(shape) * item:
            raise ValueError(f"tensor {key}: offsets {b}..{e} do not hold {shape} of {dtype} in {size} bytes")
        if (start + b) % item:
            raise ValueError(f"tensor {key} is not aligned to its element size")
        if e == b:
            out[key] = torch.empty(shape, dtype=dtype)
            continue
        view, at = blob.at(start + b, start + e)
        out[key] = over(view, dtype, (e - b) // item, at).view(shape)
    return out


def over(buffer: Any, dtype: torch.dtype = torch.uint8, count: int = -1, offset: int = 0) -> torch.Tensor:
    """A tensor over ``buffer``'s bytes, no copy. A read-only buffer (bytes, a mapped file) too: torch warns that
    such a tensor must not be written, and the fast tier only ever hashes, sends or copies from it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


def fill(template: Any, saved: Any, where: str = "") -> Any:
    """``saved`` laid into ``template`` (the state dict to load into): a tensor of the template is overwritten in
    place (a DTensor's local shard), so sharding and devices stay; everything else is taken from ``saved``."""
    if isinstance(template, torch.Tensor) and isinstance(saved, torch.Tensor | Piece):
        _same_piece(template, saved, where)
        local = template.to_local() if isinstance(template, DTensor) else template
        values = saved.tensor if isinstance(saved, Piece) else saved
        if local.shape != values.shape:
            raise CheckpointFormatError(
                f"fast tier: {where} has shape {tuple(values.shape)} in the copy, {tuple(local.shape)} here "
                "(another parallel layout: resume from the durable tier)"
            )
        if values.data_ptr() != local.data_ptr():  # else its bytes were received into it (landing.py)
            with torch.no_grad():
                local.copy_(values)
        return template
    if isinstance(template, dict) and isinstance(saved, dict):
        return {k: fill(template[k], v, f"{where}.{k}") if k in template else _plain(v) for k, v in saved.items()}
    return _plain(saved)


def _same_piece(template: torch.Tensor, saved: torch.Tensor | Piece, where: str) -> None:
    """A DTensor's shard goes only into the same piece of the same global tensor; a whole tensor only into one."""
    mine = _piece_of(template) if isinstance(template, DTensor) else None
    theirs = saved.where if isinstance(saved, Piece) else None
    if mine != theirs:
        raise CheckpointFormatError(
            f"fast tier: {where} is {_say(theirs)} in the copy, {_say(mine)} here "
            "(another parallel layout: resume from the durable tier)"
        )


def _say(p: Layout | None) -> str:
    if p is None:
        return "a whole tensor"
    pieces = ", ".join(f"{list(z)} at {list(o)}" for o, z in p[1])
    return f"the shard {pieces} of {list(p[0])}"


def _plain(saved: Any) -> Any:
    """``saved`` with each DTensor shard as its plain local tensor (a value no template tensor took), each tensor
    a copy (the blob's buffers may be files mapped from the node dir, which a later save reuses)."""
    if isinstance(saved, Piece):
        return saved.tensor.clone()
    if isinstance(saved, torch.Tensor):
        return saved.clone()
    if isinstance(saved, dict):
        return {k: _plain(v) for k, v in saved.items()}
    if isinstance(saved, list | tuple):
        return type(saved)(_plain(v) for v in saved)
    return saved
