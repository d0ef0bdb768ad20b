"""Consolidation copies stored tensor bytes without decoding them (``copy_file_range``), with a fallback."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.formats import dcp_stream
from pipeline.formats.dcp_stream import TensorStreamer, consolidate_dcp
from tests.test_io import _spawn_two


def _expected() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "emb": torch.randn(64, 16, generator=g),
        "w": torch.randn(30, 5, generator=g).to(torch.bfloat16),
        "bias": torch.arange(9, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def _save_sharded(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipeline.formats.dcp import RecordingWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = {k: distribute_tensor(v, mesh, [Shard(0)]) if k in ("emb", "w") else v for k, v in _expected().items()}
        dcp.save({"model": model, "optim": {"lr": 0.1}}, storage_writer=RecordingWriter(Path(out), threads=2))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    step = tmp_path_factory.mktemp("step")
    _spawn_two(_save_sharded, str(step))
    return step


def _check(out: Path) -> None:
    got = load_file(out)
    for name, tensor in _expected().items():
        assert torch.equal(got[name], tensor), name


def test_every_row_block_is_copied_raw(sharded_step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No chunk is decoded: the decode path is made to fail, and bytes still arrive through copy_file_range."""
    calls: list[int] = []
    real = os.copy_file_range

    def counting(*args: int) -> int:
        calls.append(args[2])
        return real(*args)

    def no_decode(*_: object) -> object:
        raise AssertionError("a row block was decoded instead of copied")

    monkeypatch.setattr(os, "copy_file_range", counting)
    monkeypatch.setattr(TensorStreamer, "iter_row_blocks", no_decode)
    out = tmp_path / "model.safetensors"
    assert consolidate_dcp(sharded_step, out) == len(_expected())
    _check(out)
    stored = sum(t.numel() * t.element_size() for t in _expected().values())
    assert sum(calls) == stored, "every stored byte of the model went through copy_file_range"


def test_copy_falls_back_where_the_filesystem_refuses(
    sharded_step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: int) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    out = tmp_path / "model.safetensors"
    consolidate_dcp(sharded_step, out)
    _check(out)


def test_a_record_that_is_not_a_plain_tensor_is_decoded(
    sharded_step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path declines what it does not recognise (here: every record), and the decode path still works."""
    monkeypatch.setattr(dcp_stream, "load_archive", lambda _archive: object())
    out = tmp_path / "model.safetensors"
    consolidate_dcp(sharded_step, out)
    _check(out)
