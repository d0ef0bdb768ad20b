"""A Hugging Face ``Trainer`` checkpoint (``checkpoint-N``'s files) as a committed step's format (``hf_trainer``).

The ``Trainer`` writes, under DDP or in one process: the model (``model.safetensors``, or the shards its
``model.safetensors.index.json`` names; a PEFT model's ``adapter_model.safetensors``), its ``config.json``,
``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json`` (the main process) and one ``rng_state_<rank>.pth`` per
rank (``rng_state.pth`` in one process). :func:`trainer_files` says which of a step's files hold its data (all
must be listed by the ranks' markers); :func:`consolidate_trainer` streams the weights into one safetensors file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import CheckpointFormatError

TRAINER_STATE = "trainer_state.json"
WEIGHTS = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
WEIGHTS_INDEX = "model.safetensors.index.json"
EXTRA = ("config.json", "adapter_config.json", "generation_config.json", "optimizer.pt", "scheduler.pt", "scaler.pt")


def trainer_files(step_dir: Path) -> set[str]:
    """The files holding ``step_dir``'s data: its state, weights (an index and the shards it names) and the
    optimizer, scheduler and RNG files the ``Trainer`` wrote; a step without state or weights is refused."""
    if not (step_dir / TRAINER_STATE).is_file():
        raise CheckpointFormatError(f"{step_dir}: no {TRAINER_STATE} (not a Trainer checkpoint)")
    files = {TRAINER_STATE}
    files |= {name for name in (*WEIGHTS, *EXTRA) if (step_dir / name).is_file()}
    files |= {p.name for p in step_dir.glob("rng_state*.pth")}
    if (step_dir / WEIGHTS_INDEX).is_file():
        files |= {WEIGHTS_INDEX, *_index_shards(step_dir / WEIGHTS_INDEX)}
    if not files & {*WEIGHTS, WEIGHTS_INDEX}:
        raise CheckpointFormatError(f"{step_dir}: no model weights ({' or '.join((*WEIGHTS, WEIGHTS_INDEX))})")
    return files


def _index_shards(index: Path) -> set[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = {str(v) for v in weight_map.values()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointFormatError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    bad = sorted(s for s in shards if "/" in s or s.startswith("."))
    if bad:
        raise CheckpointFormatError(f"{index} names shards outside its directory: {bad[:3]}")
    return shards


def consolidate_trainer(step_dir: Path, out: Path, on_tensor: Callable[[str], None] | None = None) -> int:
    """Stream the model weights of a ``Trainer`` checkpoint (safetensors, one file or shards) into one
    safetensors file, tensor by tensor; the tensor count."""
    from safetensors import safe_open  # noqa: PLC0415

    from pipeline.formats.safetensors_stream import StreamingSafetensorsWriter, TensorSpec  # noqa: PLC0415

    if (step_dir / WEIGHTS_INDEX).is_file():
        shards = sorted(_index_shards(step_dir / WEIGHTS_INDEX))
    elif (step_dir / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise CheckpointFormatError(f"{step_dir}: only safetensors weights consolidate (save_safetensors=True)")
    handles = [safe_open(str(step_dir / s), framework="pt") for s in shards]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 - safe_open has keys(), not iteration
    specs = []
    for name in sorted(where):
        meta = where[name].get_slice(name)
        specs.append(TensorSpec(name, _dtype(meta.get_dtype()), tuple(meta.get_shape())))
    with StreamingSafetensorsWriter(out, specs, metadata={"format": "pt"}) as writer:
        for spec in specs:
            writer.write(spec.name, where[spec.name].get_tensor(spec.name))
            if on_tensor is not None:
                on_tensor(spec.name)
        writer.close()
    return len(specs)


def _dtype(name: str) -> Any:
    import torch  # noqa: PLC0415

    table = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}  # fmt: skip
    if name not in table:
        raise CheckpointFormatError(f"safetensors dtype {name} is not one the consolidation writes")
    return table[name]
