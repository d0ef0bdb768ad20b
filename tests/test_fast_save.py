"""The fast DCP shard-save (no per-record CRC32, parallel writer files) stays loadable by plain ``dcp.load``."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

from pipeline.formats.dcp import RecordingWriter, crc32_off, read_metadata_safe
from pipeline.storage.integrity import hash_file
from tests.test_io import _spawn_two


def _state(rank: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)  # replicated values, as DCP expects of plain tensors
    return {
        "model": {f"w{i}": torch.randn(33 + i, 7, generator=g) for i in range(5)},
        "opt": {"step": torch.tensor(3), "lr": 0.5},
        "rank_only": {f"r{rank}": torch.arange(11 + rank, dtype=torch.bfloat16)},
    }


def _save_then_plain_load(rank: int, port: int, out: str, threads: int) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    try:
        state = _state(rank)
        writer = RecordingWriter(Path(out), threads=threads)
        dcp.save(state, storage_writer=writer)
        if torch.serialization.get_crc32_options() is not True:
            raise RuntimeError("the CRC32 option was not restored after the save")
        names = [e.path for e in writer.written]
        if not 1 <= len(names) <= threads or not all(n.startswith(f"__{rank}_") for n in names):
            raise RuntimeError(f"rank {rank} wrote {names} with {threads} threads")
        for e in writer.written:  # hashed while writing, equal to the file on disk
            if hash_file(Path(out) / e.path) != e.hash:
                raise RuntimeError(f"{e.path}: hash differs")
        dist.barrier()
        # Plain torch: its own reader and planner, not the pipeline's safe ones.
        loaded = {k: ({n: torch.zeros_like(t) for n, t in v.items()} if k != "opt" else {}) for k, v in state.items()}
        loaded["opt"] = {"step": torch.tensor(0), "lr": 0.0}
        dcp.load(loaded, storage_reader=FileSystemReader(out))
        for key in ("model", "rank_only"):
            for name, tensor in state[key].items():  # type: ignore[attr-defined]
                if not torch.equal(loaded[key][name], tensor):
                    raise RuntimeError(f"{key}.{name} differs after plain dcp.load")
        if loaded["opt"]["lr"] != 0.5 or int(loaded["opt"]["step"]) != 3:
            raise RuntimeError(f"non-tensor values differ: {loaded['opt']}")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("threads", [1, 3])
def test_fast_save_loads_with_plain_dcp_load(tmp_path: Path, threads: int) -> None:
    _spawn_two(_save_then_plain_load, str(tmp_path), threads)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert ".metadata" in files and len(files) > 1 + (threads > 1), files  # parallel files where items allow
    assert all(n == ".metadata" or n.endswith(".distcp") for n in files)
    stored = {i.relative_path for i in read_metadata_safe(tmp_path).storage_data.values()}
    assert stored == set(files) - {".metadata"}, "no empty, unlisted writer file is left behind"


def test_records_are_written_without_crc32(tmp_path: Path) -> None:
    """The redundant CRC is really off while saving (a zip record's CRC field is 0) and on again after."""
    import io

    for off in (True, False):
        buf = io.BytesIO()
        if off:
            with crc32_off():
                torch.save(torch.arange(1000.0), buf)
        else:
            torch.save(torch.arange(1000.0), buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        crc = info.CRC
        assert (crc == 0) is off, f"crc32_off={off}: CRC field {crc:#x}"
        assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), torch.arange(1000.0))
    assert torch.serialization.get_crc32_options() is True


def test_a_failing_writer_thread_fails_the_save(tmp_path: Path) -> None:
    """DCP's extra writer threads drop their items silently when they fail: the save must fail instead of
    recording a step whose metadata misses them."""
    import warnings

    from pipeline.storage.faults import io_plan

    state = {"model": {f"w{i}": torch.randn(64, 64) for i in range(6)}}
    with warnings.catch_warnings(), io_plan(fail_kind="write", fail_path="__0_1.distcp"):
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException, match="items|EIO|Input/output"):
            dcp.save(state, storage_writer=RecordingWriter(tmp_path, threads=2), no_dist=True)
    assert not (tmp_path / ".metadata").exists()


def test_metadata_is_deterministic_with_parallel_writers(tmp_path: Path) -> None:
    import warnings

    state = {"model": {f"w{i}": torch.full((100 + i,), float(i)) for i in range(12)}}
    digests = set()
    for n in range(4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=RecordingWriter(tmp_path / str(n), threads=3), no_dist=True)
        digests.add(hash_file(tmp_path / str(n) / ".metadata"))
    assert len(digests) == 1


def test_the_shard_writer_itself_writes_records_without_crc32(tmp_path: Path) -> None:
    """What RecordingWriter wrote (not only the context manager): every tensor record's CRC field is 0."""
    import io
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.randn(50, 3)}}, storage_writer=RecordingWriter(tmp_path), no_dist=True)
    infos = list(read_metadata_safe(tmp_path).storage_data.values())
    assert infos
    for info in infos:
        raw = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            assert [i.CRC for i in z.infolist() if "/data/" in i.filename] == [0]
    assert torch.serialization.get_crc32_options() is True


def test_writer_threads_default_follows_the_cpus_a_rank_has(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.config.schema import CheckpointConfig

    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    assert CheckpointConfig().writer_threads_for(world_size=8) == 3
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "32")
    assert CheckpointConfig().writer_threads_for(world_size=8) == 4  # capped
    assert CheckpointConfig(writer_threads=2).writer_threads_for(world_size=8) == 2  # an explicit value wins
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    import os

    cpus = len(os.sched_getaffinity(0))
    assert CheckpointConfig().writer_threads_for(world_size=cpus) == 1
    assert CheckpointConfig().writer_threads_for(world_size=cpus * 4) == 1  # never 0


def test_readers_and_stage_jobs_start_without_torch_dcp() -> None:
    """The committer and consolidate read DCP metadata without importing torch's DCP package, and a stage
    job's pickle (the launcher module) loads without importing torch at all."""
    import subprocess
    import sys

    code = (
        "import sys, launchers.submitit_launcher; t = 'torch' in sys.modules; "
        "import pipeline.stages.verify_manifest, pipeline.stages.consolidate, pipeline.formats.dcp_stream; "
        "print(t, 'torch.distributed.checkpoint' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"], out
