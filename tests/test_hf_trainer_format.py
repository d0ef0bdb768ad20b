"""The ``hf_trainer`` format (a Hugging Face ``Trainer``'s checkpoint files as a committed step), in-process: who
owns which file, which files hold the step's data (never a link planted in the step), and the streamed
consolidation of sharded weights, with a damaged shard refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.errors import CheckpointFormatError
from pipeline.formats.hf_trainer import consolidate_trainer, trainer_files
from pipeline.formats.registry import FORMATS, HF_TRAINER


def _step(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    step = tmp_path / "step_8"
    step.mkdir()
    tensors = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(4, dtype=torch.bfloat16)}
    save_file({"a.weight": tensors["a.weight"]}, str(step / "model-00001-of-00002.safetensors"))
    save_file({"b.bias": tensors["b.bias"]}, str(step / "model-00002-of-00002.safetensors"))
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors"}
    (step / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name in ("trainer_state.json", "config.json", "rng_state_0.pth", "rng_state_1.pth"):
        (step / name).write_text("{}")
    return step, tensors


def test_owners_stored_files_and_world(tmp_path: Path) -> None:
    fmt = FORMATS[HF_TRAINER]
    assert [fmt.owner(n) for n in ("rng_state_1.pth", "optimizer.pt", "rank_1.done.json")] == [1, 0, None]
    step, _ = _step(tmp_path)
    (step / "optimizer.pt").symlink_to(step / "config.json")  # planted: not a file of the step
    stored = trainer_files(step)
    assert "optimizer.pt" not in stored and {"model-00002-of-00002.safetensors", "rng_state_1.pth"} <= stored
    assert fmt.world_size_of(step, stored, False) == 2
    (step / "trainer_state.json").unlink()
    with pytest.raises(CheckpointFormatError, match="no trainer_state.json"):
        trainer_files(step)


def test_sharded_weights_consolidate_into_one_file_and_a_damaged_shard_is_one_line(tmp_path: Path) -> None:
    step, tensors = _step(tmp_path)
    assert consolidate_trainer(step, tmp_path / "one.safetensors") == 2
    out = load_file(str(tmp_path / "one.safetensors"))
    assert out.keys() == tensors.keys() and all(torch.equal(out[k], tensors[k]) for k in tensors)
    (step / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointFormatError, match="is not a readable safetensors file"):
        consolidate_trainer(step, tmp_path / "two.safetensors")
