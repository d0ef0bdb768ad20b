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
from pipeline.storage.integrity import lstat_kind

TRAINER_STATE = "trainer_state.json"
WEIGHTS = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
WEIGHTS_INDEX = "model.safetensors.index.json"
EXTRA = ("config.json", "adapter_config.json", "generation_config.json", "optimizer.pt", "scheduler.pt", "scaler.pt")


def trainer_files(step_dir: Path) -> set[str]:
    """The files holding ``step_dir``'s data: its state, weights (an index and the shards it names) and the
    optimizer, scheduler and RNG files the ``Trainer`` wrote; a step without state or weights is refused."""
    if not _is_file(step_dir / TRAINER_STATE):
        raise CheckpointFormatError(f"{step_dir}: no {TRAINER_STATE} (not a Trainer checkpoint)")
    files = {TRAINER_STATE}
    files |= {name for name in (*WEIGHTS, *EXTRA) if _is_file(step_dir / name)}
    files |= {p.name for p in step_dir.glob("rng_state*.pth")}
    if _is_file(step_dir / WEIGHTS_INDEX):
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
    safetensors file, tensor by tensor (memory: the largest tensor); the tensor count."""
    from contextlib import ExitStack  # noqa: PLC0415

    from safetensors import SafetensorError, safe_open  # noqa: PLC0415

    from pipeline.formats.safetensors_shards import unreadable  # noqa: PLC0415
    from pipeline.formats.safetensors_stream import DTYPES, StreamingSafetensorsWriter, TensorSpec  # noqa: PLC0415

    if _is_file(step_dir / WEIGHTS_INDEX):
        shards = sorted(_index_shards(step_dir / WEIGHTS_INDEX))
    elif _is_file(step_dir / "model.safetensors"):
        shards = ["model.safetensors"]
    else:
        raise CheckpointFormatError(f"{step_dir}: only safetensors weights consolidate (save_safetensors=True)")
    by_code = {code: dtype for dtype, code in DTYPES.items()}
    with ExitStack() as files:
        where: dict[str, Any] = {}
        specs = []
        for shard in shards:
            try:
                handle = files.enter_context(safe_open(str(step_dir / shard), framework="pt"))
                for name in handle.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    meta = handle.get_slice(name)
                    if meta.get_dtype() not in by_code:
                        raise CheckpointFormatError(f"{step_dir / shard}: {name} is {meta.get_dtype()}, not a dtype "
                                                    "the consolidation writes")  # fmt: skip
                    where[name] = handle
                    specs.append(TensorSpec(name, by_code[meta.get_dtype()], tuple(meta.get_shape())))
            except SafetensorError as e:
                raise unreadable(step_dir / shard, e) from None
        specs.sort(key=lambda spec: spec.name)
        with StreamingSafetensorsWriter(out, specs, metadata={"format": "pt"}) as writer:
            for spec in specs:
                writer.write(spec.name, where[spec.name].get_tensor(spec.name))
                if on_tensor is not None:
                    on_tensor(spec.name)
            writer.close()
    return len(specs)


def _is_file(path: Path) -> bool:
    """A regular file itself (never through a link planted in the step)."""
    return lstat_kind(path) == "file"
