"""A full-tensor safetensors file as Hugging Face's sharded layout: ``model-0000i-of-0000n.safetensors`` shards
no larger than a limit (a tensor larger than that gets a shard of its own) and ``model.safetensors.index.json``.
Memory: one tensor at a time (read through safetensors' mmap, written with the streaming writer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pipeline.errors import CheckpointFormatError
from pipeline.formats.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from pipeline.storage.atomic import write_json_atomic

INDEX = "model.safetensors.index.json"


def plan_shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, in name order: start a new shard when the next tensor would push this one past ``max_bytes``."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def write_sharded(
    src: Path,
    out_dir: Path,
    dtype: torch.dtype,
    max_bytes: int,
    tensors: Sequence[tuple[str, tuple[int, ...], Callable[[Any], torch.Tensor]]] | None = None,
    index: str | None = INDEX,
    stem: str = "model",
) -> list[str]:
    """Write ``src``'s tensors (cast to ``dtype``) into shards and the index under ``out_dir``; returns the
    file names written. ``tensors``: (name, shape, read from the open file) of each tensor to write instead of
    all of them as they are; ``index`` None: one file ``<stem>.safetensors``, no index. An unreadable ``src``
    raises :class:`CheckpointFormatError` (one line)."""
    try:
        return _write_sharded(src, out_dir, dtype, max_bytes, tensors, index, stem)
    except SafetensorError as e:
        raise unreadable(src, e) from None


def _write_sharded(
    src: Path,
    out_dir: Path,
    dtype: torch.dtype,
    max_bytes: int,
    tensors: Sequence[tuple[str, tuple[int, ...], Callable[[Any], torch.Tensor]]] | None,
    index: str | None,
    stem: str,
) -> list[str]:
    with safe_open(str(src), framework="pt") as f:
        if tensors is None:
            tensors = [(n, tuple(f.get_slice(n).get_shape()), reader(n)) for n in sorted(f.keys())]
        readers = {name: read for name, _, read in tensors}
        specs = [TensorSpec(n, dtype, shape) for n, shape, _ in tensors]
        shards = plan_shards(specs, max_bytes if index is not None else 2**62)
        weight_map: dict[str, str] = {}
        files: list[str] = []
        for i, shard in enumerate(shards, start=1):
            fname = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors" if index else f"{stem}.safetensors"
            with StreamingSafetensorsWriter(out_dir / fname, shard, metadata={"format": "pt"}) as writer:
                for spec in shard:
                    writer.write(spec.name, readers[spec.name](f).to(dtype).contiguous())
                    weight_map[spec.name] = fname
                writer.close()
            files.append(fname)
    if index is None:
        return files
    total = sum(s.nbytes for s in specs)
    write_json_atomic(out_dir / index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files + [index]


def reader(name: str) -> Callable[[Any], torch.Tensor]:
    """Reads tensor ``name`` from an open safetensors file (a ``tensors`` entry of :func:`write_sharded`)."""
    return lambda f: f.get_tensor(name)


def stored_shapes(src: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape in a safetensors file (its header only); an unreadable file raises
    :class:`CheckpointFormatError` (one line)."""
    try:
        with safe_open(str(src), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in sorted(f.keys())}
    except SafetensorError as e:
        raise unreadable(src, e) from None


def unreadable(src: Path, e: SafetensorError) -> CheckpointFormatError:
    """A safetensors file whose header or data is malformed, as one line."""
    return CheckpointFormatError(
        f"{src} is not a readable safetensors file ({(str(e) or type(e).__name__).splitlines()[0][:200]})"
    )
