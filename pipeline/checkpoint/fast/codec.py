"""One rank's state as one self-describing blob, and back, with nothing unpickled.

A fast-tier copy holds what this rank has of the state dict (:func:`pipeline.checkpoint.state.save_state`'s
structure: FSDP2's DTensors as their local shards, DDP's replicated tensors whole), so it restores only at the
same world size and layout, into the same rank. The blob is a safetensors file whose metadata holds the
skeleton as JSON (containers, scalars, strings, bytes and where each tensor goes): decoding parses JSON and
safetensors, never pickle.

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

SKELETON_KEY = "pipeline.fast.skeleton"
"""The safetensors metadata entry that holds the skeleton."""
_HEAD = struct.Struct("<Q")
"""safetensors' own first 8 bytes: the length of its JSON header."""


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


def pack(snap: Snapshot) -> bytes:
    """The blob of ``snap``: safetensors, the skeleton in its metadata (no second copy of the tensors' bytes).
    The snapshot's tensors are released as soon as they are serialised."""
    skeleton = json.dumps(snap.skeleton, separators=(",", ":"))
    tensors, snap.tensors = snap.tensors, {}
    blob = st_save(tensors, metadata={SKELETON_KEY: skeleton})
    tensors.clear()
    return blob


def unpack(blob: bytes, what: str) -> Any:
    """The state a blob holds (CPU tensors); ``what`` names it in errors."""
    try:
        (n,) = _HEAD.unpack_from(blob)
        header = json.loads(bytes(blob[_HEAD.size : _HEAD.size + n]))
        skeleton = json.loads(header["__metadata__"][SKELETON_KEY])
        tensors = st_load(blob)
    except (ValueError, RuntimeError, SafetensorError, KeyError, TypeError, struct.error) as e:
        raise CheckpointFormatError(f"{what}: not a readable fast-tier copy ({e})") from e

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
