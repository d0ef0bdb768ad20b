"""Atomic publishing, safe paths, streaming safetensors, and the restricted DCP metadata reader."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from pipeline.errors import CheckpointFormatError, PipelineError, UnsafePathError, VerificationError
from pipeline.formats import dcp_metadata, dcp_values
from pipeline.formats.dcp import load_into, read_metadata_safe
from pipeline.formats.dcp_stream import TensorStreamer
from pipeline.formats.safetensors_shards import plan_shards
from pipeline.formats.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from pipeline.storage.atomic import publish_dir, write_json_atomic
from pipeline.storage.integrity import describe, safe_join, verify_entries
from tests.conftest import ROOT


def test_atomic_json_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert target.read_text().strip().endswith("}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_publish_dir_never_overwrites(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("1")
    (tmp_path / "b").mkdir()
    with pytest.raises(PipelineError, match="already exists"):
        publish_dir(tmp_path / "a", tmp_path / "b")
    publish_dir(tmp_path / "a", tmp_path / "c")
    assert (tmp_path / "c" / "f").read_text() == "1" and not (tmp_path / "a").exists()


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../x", "", "a//b", "./a"])
def test_manifest_paths_cannot_escape(tmp_path: Path, rel: str) -> None:
    with pytest.raises(UnsafePathError, match="unsafe path"):
        safe_join(tmp_path, rel)


def test_symlink_out_of_run_dir_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("secret")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside, run / "link")
    with pytest.raises(UnsafePathError, match="is a symlink"):
        safe_join(run, "link")


def test_verify_entries_names_the_bad_file(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(b"abcdef")
    entry = describe(tmp_path, "w.bin")
    verify_entries(tmp_path, [entry], "marker")
    (tmp_path / "w.bin").write_bytes(b"abcdeX")
    with pytest.raises(VerificationError, match=r"w\.bin: content differs from marker \(xxh3_128"):
        verify_entries(tmp_path, [entry], "marker")
    (tmp_path / "w.bin").write_bytes(b"abc")
    with pytest.raises(VerificationError, match=r"w\.bin: size 3 != 6"):
        verify_entries(tmp_path, [entry], "marker")


def test_streaming_safetensors_matches_reference(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 2).to(torch.bfloat16),
        "d": torch.tensor(3.5),
    }
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    writer = StreamingSafetensorsWriter(tmp_path / "m.safetensors", specs, metadata={"format": "pt"})
    for n, t in tensors.items():
        writer.write(n, t)
    writer.close()
    loaded = load_file(str(tmp_path / "m.safetensors"))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_streaming_writer_rejects_unplanned_tensor(tmp_path: Path) -> None:
    writer = StreamingSafetensorsWriter(tmp_path / "m.safetensors", [TensorSpec("a", torch.float32, (2,))])
    with pytest.raises(CheckpointFormatError, match="expected a"):
        writer.write("a", torch.zeros(3))
    with pytest.raises(CheckpointFormatError, match="only 0 of 1"):
        writer.close()


def test_plan_shards_respects_max_size() -> None:
    specs = [TensorSpec(f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5, 100])]
    shards = plan_shards(specs, max_bytes=100)  # 40, 40, 120, 20, 400 bytes
    assert [[s.name for s in sh] for sh in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]


def _tiny_dcp(path: Path) -> dict[str, torch.Tensor]:
    model = {"w": torch.randn(4, 3), "b": torch.arange(4, dtype=torch.int64)}
    dcp.save({"model": model, "sched": {"last_epoch": 3, "base_lrs": [0.1]}}, checkpoint_id=str(path), no_dist=True)
    return model


def test_dcp_metadata_is_read_without_arbitrary_unpickling(tmp_path: Path) -> None:
    model = _tiny_dcp(tmp_path)
    md = read_metadata_safe(tmp_path)
    assert {"model.w", "model.b", "sched.last_epoch"} <= set(md.state_dict_metadata)
    streamer = TensorStreamer(tmp_path, "model.")
    got = {k: streamer.load(k, m).clone() for k, m in streamer.entries}
    assert set(got) == {"model.w", "model.b"}
    assert torch.equal(got["model.w"], model["w"]) and torch.equal(got["model.b"], model["b"])
    state = {"sched": {"last_epoch": 0, "base_lrs": [0.0]}}
    load_into(state, tmp_path, no_dist=True)
    assert state["sched"] == {"last_epoch": 3, "base_lrs": [0.1]}


def test_dcp_metadata_is_read_without_importing_torch(tmp_path: Path) -> None:
    """The committer reads every step's metadata: it does so without ``import torch`` (3 CPU-seconds and 300 MB
    per process); the stand-ins name exactly torch's own dtypes and memory formats, and convert back to them."""
    model = _tiny_dcp(tmp_path)
    code = (
        "import sys; from pathlib import Path; from pipeline.formats.dcp_metadata import stored_files, "
        f"read_metadata_safe; print(sorted(stored_files(Path({str(tmp_path)!r})))); "
        "print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert proc.stdout.splitlines()[-1] == "False", proc.stdout
    assert ".metadata" in proc.stdout.splitlines()[0]
    assert {n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)} == dcp_values.DTYPES
    assert {n for n in dir(torch) if isinstance(getattr(torch, n), torch.memory_format)} == dcp_values.MEMORY_FORMATS
    md = read_metadata_safe(tmp_path)
    real = dcp_metadata.to_torch(md)
    w = real.state_dict_metadata["model.w"]
    assert w.size == torch.Size([4, 3]) and type(w.size) is torch.Size and w.properties.dtype == model["w"].dtype
    assert w.properties.layout is torch.strided and w.properties.memory_format is torch.contiguous_format
    assert md.state_dict_metadata["model.b"].properties.torch_dtype() is torch.int64


class _Evil:
    def __reduce__(self):  # runs os.system on plain pickle.load
        return (os.system, ("touch pwned",))


def test_malicious_dcp_metadata_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointFormatError, match=r"(posix|os)\.system is not allowed in DCP metadata"):
        read_metadata_safe(tmp_path)
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def _spawn_two(fn: Callable[..., None], *args: object) -> None:
    """Run ``fn(rank, port, *args)`` on 2 spawned ranks that join one gloo group on a free local port."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(fn, args=(port, *args), nprocs=2, join=True)


def _two_rank_save(rank: int, port: int, out: str, results: dict) -> None:  # type: ignore[type-arg]
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipeline.formats.dcp import RecordingWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    state = {
        "model": {"w": distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)]), "b": torch.arange(5)},
        "sched": {"last_epoch": 3},
    }
    writer = RecordingWriter(Path(out))
    dcp.save(state, storage_writer=writer)
    results[rank] = [(e.path, e.size, e.hash) for e in writer.written]
    dist.destroy_process_group()


@pytest.mark.distributed
def test_hashes_computed_while_writing_match_the_files(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    _spawn_two(_two_rank_save, str(tmp_path), results)
    seen = set()
    for rank in (0, 1):
        assert results[rank], f"rank {rank} recorded no files"
        for path, size, digest in results[rank]:
            assert path.startswith(f"__{rank}_"), "each rank records only its own files"
            assert (tmp_path / path).stat().st_size == size
            assert describe(tmp_path, path).hash == digest
            seen.add(path)
    assert seen == {p.name for p in tmp_path.glob("*.distcp")}


def _full_model_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "rows": torch.randn(64, 8, generator=g),  # Shard(0): two row blocks -> streamed chunk by chunk
        "uneven": torch.randn(5, 3, generator=g),  # Shard(0) over 2 ranks: blocks of 3 and 2 rows
        "cols": torch.randn(6, 10, generator=g),  # Shard(1): not row blocks -> assembled in the buffer
        "replicated": torch.arange(12, dtype=torch.int64).view(3, 4),  # plain tensor: one chunk
        "scalar": torch.tensor(2.5),
    }


def _two_rank_model_save(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    full = _full_model_tensors()
    model = {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "uneven": distribute_tensor(full["uneven"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "replicated": full["replicated"],
        "scalar": full["scalar"],
    }
    dcp.save({"model": model, "optim": {"x": torch.ones(3)}}, checkpoint_id=out)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_consolidation_streams_row_blocks_and_assembles_the_rest(tmp_path: Path) -> None:
    from pipeline.formats.dcp_stream import TensorStreamer, consolidate_dcp

    ckpt = tmp_path / "ckpt"
    _spawn_two(_two_rank_model_save, str(ckpt))
    streamer = TensorStreamer(ckpt, "model.")
    paths = {k: streamer.row_blocks(k, m) is not None for k, m in streamer.entries}
    assert paths == {
        "model.rows": True,
        "model.uneven": True,
        "model.cols": False,
        "model.replicated": True,
        "model.scalar": True,
    }
    assert len(streamer.row_blocks("model.rows", dict(streamer.entries)["model.rows"]) or []) == 2

    out = tmp_path / "model.safetensors"
    assert consolidate_dcp(ckpt, out) == 5
    got = load_file(str(out))
    want = _full_model_tensors()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_a_marker_whose_step_was_published_before_its_closing_fsync_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's done-marker is its last write into the staged step: the committer may publish the step between the
    marker's rename and the closing ``fsync`` of the directory. That is no failure of the rank's; any other write
    into a directory that vanished still fails."""
    from pipeline.checkpoint.manifest import Marker, marker_path, write_marker  # noqa: PLC0415
    from pipeline.storage import atomic  # noqa: PLC0415

    staged, published = tmp_path / "staging" / "step_4", tmp_path / "step_4"
    staged.mkdir(parents=True)
    real = atomic.fsync_dir

    def published_first(path: Path) -> None:
        if Path(path) == staged and staged.exists():
            staged.rename(published)  # the committer, between the rename and the fsync
        real(path)

    monkeypatch.setattr(atomic, "fsync_dir", published_first)
    write_marker(staged, Marker(step=4, rank=0, world_size=1, format="dcp", attempt="a1", files=()))
    assert marker_path(published, 0).is_file()
    published.rename(staged)
    with pytest.raises(FileNotFoundError):
        atomic.write_json_atomic(staged / "other.json", {})
