"""One rank's state as one self-describing blob, and back, with nothing unpickled.

A fast-tier copy holds what this rank has of the state dict (:func:`pipeline.checkpoint.state.save_state`'s
structure: FSDP2's DTensors as their local shards, DDP's replicated tensors whole), so it restores only at the
same world size and layout, into the same rank. The blob is ``PFT1``, the skeleton's length (8 bytes, little
endian), the skeleton as JSON (containers, scalars, strings, bytes and where each tensor goes), then the tensors
as safetensors: decoding parses JSON and safetensors, never pickle.

Copying the tensors to CPU (:func:`snapshot`) is what training waits for; :func:`pack` (serialising) runs in the
background.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch.distributed.tensor import DTensor

from pipeline.errors import CheckpointFormatError

MAGIC = b"PFT1"
_HEAD = struct.Struct("<4sQ")


@dataclass
class Snapshot:
    """A rank's state copied off the training tensors: the skeleton and the CPU tensors it names."""

    skeleton: Any
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def snapshot(state: Any) -> Snapshot:
    """``state`` with every tensor copied to CPU (a DTensor: its local shard), so training may go on."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(v: Any, where: str) -> Any:
        if isinstance(v, torch.Tensor):
            local = v.to_local() if isinstance(v, DTensor) else v
            key = f"t{len(tensors)}"
            tensors[key] = local.detach().to("cpu", copy=True).contiguous()
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

    return Snapshot(walk(state, ""), tensors)


def pack(snap: Snapshot) -> bytearray:
    """The blob of ``snap`` (magic, skeleton, safetensors)."""
    skeleton = json.dumps(snap.skeleton, separators=(",", ":")).encode()
    out = bytearray(_HEAD.pack(MAGIC, len(skeleton)))
    out += skeleton
    out += st_save(snap.tensors)
    return out


def unpack(blob: bytes | memoryview, what: str) -> Any:
    """The state a blob holds (CPU tensors); ``what`` names it in errors."""
    view = memoryview(blob)
    if len(view) < _HEAD.size:
        raise CheckpointFormatError(f"{what}: {len(view)} bytes is too short for a fast-tier copy")
    magic, n = _HEAD.unpack_from(view)
    if magic != MAGIC or _HEAD.size + n > len(view):
        raise CheckpointFormatError(f"{what}: not a fast-tier copy (bad header)")
    try:
        skeleton = json.loads(bytes(view[_HEAD.size : _HEAD.size + n]))
        tensors = st_load(bytes(view[_HEAD.size + n :]))
    except (ValueError, RuntimeError, SafetensorError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointFormatError(f"{what}: unreadable fast-tier copy ({e})") from e

    def build(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise CheckpointFormatError(f"{what}: malformed skeleton node {str(node)[:80]}")
        ((tag, value),) = node.items()
        if tag == "T":
            if value not in tensors:
                raise CheckpointFormatError(f"{what}: skeleton names tensor {value!r} the copy lacks")
            return tensors[value]
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


def fill(template: Any, saved: Any, where: str = "") -> Any:
    """``saved`` laid into ``template`` (the state dict to load into): a tensor of the template is overwritten in
    place (a DTensor's local shard), so sharding and devices stay; everything else is taken from ``saved``."""
    if isinstance(template, torch.Tensor) and isinstance(saved, torch.Tensor):
        local = template.to_local() if isinstance(template, DTensor) else template
        if local.shape != saved.shape:
            raise CheckpointFormatError(
                f"fast tier: {where} has shape {tuple(saved.shape)} in the copy, {tuple(local.shape)} here "
                "(another parallel layout: resume from the durable tier)"
            )
        with torch.no_grad():
            local.copy_(saved)
        return template
    if isinstance(template, dict) and isinstance(saved, dict):
        return {k: fill(template[k], v, f"{where}.{k}") if k in template else v for k, v in saved.items()}
    return saved
