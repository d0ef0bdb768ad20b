"""Checkpoint formats as data: a committed step's manifest names its format, and readers are picked by it.

Each :class:`Format` answers, from the step's own files (never from a directory listing alone):

* ``stored_files(step_dir, allow_pickle)``: the files its metadata says hold data (every one must be listed by a
  marker);
* ``owner(rel_path)``: which rank writes a file, from its name (None: any rank may; the committer refuses a
  marker listing a file another rank owns);
* ``world_size(step_dir, allow_pickle)``: how many ranks wrote the step, from the files;
* ``world_of_stored(stored_files)`` (optional): the same from the set ``stored_files`` returned, for a format
  that derives it from the file names (DCP), so the committer does not read and check the metadata twice;
* ``consolidate(step_dir, out, on_tensor, allow_pickle)``: stream the model's full tensors into one safetensors
  file (memory bounded by the largest tensor or partition), returning the tensor count; None for a format
  without weights.

``allow_pickle`` is ``import.allow_pickle``: whether files that need full unpickling may be read (an imported
checkpoint the user trusts); the pipeline's own steps never need it.

Formats: ``torch_dcp`` (DDP/FSDP2), ``deepspeed_zero1|2|3`` (DeepSpeed's own layout), ``torch_save`` (one
``torch.save`` file, imported), ``hf_trainer`` (a Hugging Face ``Trainer``'s checkpoint,
:mod:`pipeline.integrations.hf`). Tests may register their own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import CheckpointFormatError
from pipeline.formats.dcp_names import DATA_FILE, METADATA_FILE
from pipeline.formats.deepspeed_names import STAGE_OF

OnTensor = Callable[[str], None] | None


@dataclass(frozen=True)
class Format:
    name: str
    stored_files: Callable[[Path, bool], set[str]]
    owner: Callable[[str], int | None]
    world_size: Callable[[Path, bool], int]
    consolidate: Callable[[Path, Path, OnTensor, bool], int] | None = None
    world_of_stored: Callable[[set[str]], int] | None = None

    def world_size_of(self, step_dir: Path, stored: set[str], allow_pickle: bool) -> int:
        """How many ranks wrote the step whose ``stored_files`` are ``stored`` (without re-reading them if the
        format can tell from the set)."""
        if self.world_of_stored is not None:
            return self.world_of_stored(stored)
        return self.world_size(step_dir, allow_pickle)


def _dcp_owner(rel: str) -> int | None:
    if rel == METADATA_FILE:
        return 0  # DCP's coordinator writes it
    m = DATA_FILE.match(rel)
    return int(m.group(1)) if m else None


def _dcp_stored(step_dir: Path, _allow_pickle: bool = False) -> set[str]:
    from pipeline.formats.dcp_metadata import stored_files  # noqa: PLC0415

    return stored_files(step_dir)


def _dcp_world(step_dir: Path, _allow_pickle: bool = False) -> int:
    return _dcp_world_of(_dcp_stored(step_dir))


def _dcp_world_of(stored: set[str]) -> int:
    ranks = {_dcp_owner(rel) for rel in stored}
    return max((r for r in ranks if r is not None), default=0) + 1


def _dcp_consolidate(step_dir: Path, out: Path, on_tensor: OnTensor, _allow_pickle: bool = False) -> int:
    from pipeline.formats.dcp_stream import consolidate_dcp  # noqa: PLC0415

    return consolidate_dcp(step_dir, out, on_tensor)


_ZERO_RANK = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$")
_ZERO_OFFLOAD = re.compile(r"^offloaded_tensors/rank(\d+)/")
_TRAIN_STATE = re.compile(r"^train_state_rank_(\d+)\.json$")


def _zero_owner(rel: str) -> int | None:
    if rel == "mp_rank_00_model_states.pt":
        return 0  # ZeRO-1/2: data-parallel rank 0 writes the module's states
    for pattern in (_ZERO_RANK, _ZERO_OFFLOAD, _TRAIN_STATE):
        m = pattern.search(rel)
        if m:
            return int(m.group(1))
    return None


def _zero_stored(step_dir: Path, allow_pickle: bool = False) -> set[str]:
    from pipeline.formats.deepspeed_zero import ZeroCheckpoint  # noqa: PLC0415

    with ZeroCheckpoint(step_dir, allow_pickle=allow_pickle) as ckpt:
        return ckpt.stored_files()


def _zero_world(step_dir: Path, allow_pickle: bool = False) -> int:
    from pipeline.formats.deepspeed_zero import ZeroCheckpoint  # noqa: PLC0415

    with ZeroCheckpoint(step_dir, allow_pickle=allow_pickle) as ckpt:
        return ckpt.world_size


def _zero_consolidate(step_dir: Path, out: Path, on_tensor: OnTensor, allow_pickle: bool = False) -> int:
    from pipeline.formats.deepspeed_zero import consolidate_zero  # noqa: PLC0415

    return consolidate_zero(step_dir, out, on_tensor=on_tensor, allow_pickle=allow_pickle)


TORCH_SAVE = "torch_save"


def _torch_save_stored(step_dir: Path, _allow_pickle: bool = False) -> set[str]:
    from pipeline.formats.torch_save import FILE  # noqa: PLC0415

    return {FILE}


def _torch_save_owner(_rel: str) -> int:
    return 0  # one file, written by one process


def _torch_save_world(_step_dir: Path, _allow_pickle: bool = False) -> int:
    return 1


def _torch_save_consolidate(step_dir: Path, out: Path, on_tensor: OnTensor, allow_pickle: bool = False) -> int:
    from pipeline.formats.torch_save import consolidate_torch_save  # noqa: PLC0415

    return consolidate_torch_save(step_dir, out, on_tensor, allow_pickle=allow_pickle)


HF_TRAINER = "hf_trainer"
_HF_RNG = re.compile(r"^rng_state_(\d+)\.pth$")
_HF_MARKER = re.compile(r"^rank_\d+\.done\.json$")


def _hf_owner(rel: str) -> int | None:
    """A Hugging Face ``Trainer`` checkpoint under DDP (or one process): each rank writes its ``rng_state_<r>.pth``,
    the main process everything else (the model, ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``)."""
    if _HF_MARKER.match(rel):
        return None
    m = _HF_RNG.match(rel)
    return int(m.group(1)) if m else 0


def _hf_stored(step_dir: Path, _allow_pickle: bool = False) -> set[str]:
    """What a Trainer checkpoint must hold: its state, the model's config and weights (one file, or the shards
    its index names), and, when it saved them, the RNG states of every rank."""
    from pipeline.formats.hf_trainer import trainer_files  # noqa: PLC0415

    return trainer_files(step_dir)


def _hf_world(step_dir: Path, _allow_pickle: bool = False) -> int:
    return _hf_world_of(_hf_stored(step_dir))


def _hf_world_of(stored: set[str]) -> int:
    ranks = [int(m.group(1)) for rel in stored if (m := _HF_RNG.match(rel))]
    return max(ranks, default=0) + 1


def _hf_consolidate(step_dir: Path, out: Path, on_tensor: OnTensor, _allow_pickle: bool = False) -> int:
    from pipeline.formats.hf_trainer import consolidate_trainer  # noqa: PLC0415

    return consolidate_trainer(step_dir, out, on_tensor)


FORMATS: dict[str, Format] = {
    "torch_dcp": Format("torch_dcp", _dcp_stored, _dcp_owner, _dcp_world, _dcp_consolidate, _dcp_world_of),
    **{name: Format(name, _zero_stored, _zero_owner, _zero_world, _zero_consolidate) for name in STAGE_OF},
    TORCH_SAVE: Format(TORCH_SAVE, _torch_save_stored, _torch_save_owner, _torch_save_world, _torch_save_consolidate),
    HF_TRAINER: Format(HF_TRAINER, _hf_stored, _hf_owner, _hf_world, _hf_consolidate, _hf_world_of),
}


def get_format(name: str, where: object = "") -> Format:
    fmt = FORMATS.get(name)
    if fmt is None:
        raise CheckpointFormatError(
            f"{where}{': ' if where else ''}format {name!r} is not one this pipeline reads (known: {sorted(FORMATS)})"
        )
    return fmt
