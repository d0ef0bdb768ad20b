"""The ``torch_save`` format: one ``torch.save`` file (a DDP rank-0 save, a ``model.state_dict()``), imported.

Read with :mod:`pipeline.formats.torch_zip`: the pickle is parsed by a restricted unpickler (tensors and plain
containers; anything else needs ``import.allow_pickle=true``) and tensors are read lazily, so consolidation holds
one slice of one tensor at a time. The model's weights are the mapping of tensors under ``model``, ``state_dict``,
``module`` or ``model_state_dict``, else the top-level mapping of tensors; a DDP ``module.`` prefix is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import CheckpointFormatError
from pipeline.formats.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from pipeline.formats.torch_zip import LazyTensor, load_lazy

FILE = "checkpoint.pt"
"""The name an imported ``torch.save`` file has in its step."""
WEIGHT_KEYS = ("model", "state_dict", "module", "model_state_dict")
STEP_KEYS = ("step", "global_step", "global_steps")
CHUNK_BYTES = 64 << 20
"""Largest slice of a tensor held at once while consolidating."""


def model_weights(tree: Any, where: Path) -> dict[str, LazyTensor]:
    # The nested state dict first: a top level that holds it may also hold stray tensors (``torch.get_rng_state()``).
    candidates = [tree[k] for k in WEIGHT_KEYS if isinstance(tree, dict) and isinstance(tree.get(k), dict)] + [tree]
    for cand in candidates:
        tensors = {str(k): v for k, v in cand.items() if isinstance(v, LazyTensor)} if isinstance(cand, dict) else {}
        if tensors:
            if all(k.startswith("module.") for k in tensors):
                tensors = {k[len("module.") :]: v for k, v in tensors.items()}
            return tensors
    raise CheckpointFormatError(
        f"{where} holds no mapping of tensors (top level, or under {', '.join(WEIGHT_KEYS)}): not a model checkpoint"
    )


def probe_file(path: Path, allow_pickle: bool = False) -> int | None:
    """Check that ``path`` is a model checkpoint this format reads; the step it records, if any."""
    tree = load_lazy(path, allow_pickle=allow_pickle)
    model_weights(tree, path)
    if isinstance(tree, dict):
        for key in STEP_KEYS:
            value = tree.get(key)
            if type(value) is int and value >= 1:
                return value
    return None


def _parts(t: LazyTensor) -> Iterator[torch.Tensor]:
    if not t.is_contiguous():
        yield t.materialize()
        return
    per = max(1, CHUNK_BYTES // max(1, t.dtype.itemsize))
    for start in range(0, t.numel, per):
        yield t.read(start, min(per, t.numel - start))


def consolidate_torch_save(
    step_dir: Path, out: Path, on_tensor: Callable[[str], None] | None = None, allow_pickle: bool = False
) -> int:
    """Stream the model weights of ``step_dir/checkpoint.pt`` into one safetensors file; the tensor count."""
    path = step_dir / FILE
    weights = model_weights(load_lazy(path, allow_pickle=allow_pickle), path)
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in weights.items()]
    with StreamingSafetensorsWriter(out, specs, metadata={"format": "pt"}) as writer:
        for spec in specs:
            writer.write_parts(spec.name, (p.reshape(-1) for p in _parts(weights[spec.name])))
            if on_tensor is not None:
                on_tensor(spec.name)
        writer.close()
    return len(specs)
