"""The committer at many ranks (a simulated DCP step, ``bench/scale_commit.py``), and the parallel verify's errors:
whatever order the readers finish in, the error names the first bad file in list order."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from bench.scale_commit import STEP, stage_dcp_step
from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.driver.task import execute_task
from pipeline.errors import VerificationError
from pipeline.storage import integrity
from pipeline.storage.integrity import FileEntry, describe, verify_entries
from tests.conftest import RunFactory


@pytest.mark.parametrize("ranks", [64, 256])
def test_simulated_dcp_step_of_many_ranks_commits(make_run: RunFactory, ranks: int) -> None:
    cfg, layout = make_run(f"strategy.world_size={ranks}", f"train.global_batch_size={ranks}")
    written = stage_dcp_step(layout.staged_step(STEP), ranks, files_per_rank=8, file_kb=1)
    assert len(written) == ranks * 8 + 1  # + .metadata

    summary = execute_task("verify_manifest", cfg, str(layout.run_dir), "scale-test")

    assert summary["committed"] == [STEP]
    latest = read_latest(layout)
    assert latest is not None and latest.step == STEP
    manifest = read_manifest(layout.committed_step(STEP))
    assert [f.path for f in manifest.files] == written
    assert manifest.world_size == ranks and manifest.format == "torch_dcp"


def test_commit_names_the_first_bad_file_of_the_first_bad_marker(make_run: RunFactory) -> None:
    ranks = 16
    cfg, layout = make_run(f"strategy.world_size={ranks}", f"train.global_batch_size={ranks}")
    staged = layout.staged_step(STEP)
    stage_dcp_step(staged, ranks, files_per_rank=8, file_kb=1)
    for name in ("__11_1.distcp", "__3_6.distcp"):  # rank 3's marker comes first
        data = bytearray((staged / name).read_bytes())
        data[-1] ^= 0xFF
        (staged / name).write_bytes(bytes(data))

    with pytest.raises(VerificationError) as err:
        execute_task("verify_manifest", cfg, str(layout.run_dir), "scale-test")

    msg = str(err.value)
    assert "__3_6.distcp: content differs from" in msg and "rank_3.done.json" in msg
    assert "__11_1" not in msg
    assert read_latest(layout) is None and not staged.exists()  # quarantined, not committed


def _files(root: Path, n: int, size: int = 3_000_000) -> list[FileEntry]:
    """``n`` files; at 3 MB, three make one reader's task (8 MiB), so 12 files are hashed by 4 tasks at once."""
    for i in range(n):
        (root / f"f{i:02d}.bin").write_bytes(os.urandom(size))
    return [describe(root, f"f{i:02d}.bin") for i in range(n)]


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def test_parallel_verify_names_the_first_corrupted_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = _files(tmp_path, 12)
    threads: set[str] = set()
    real_hash = integrity.hash_file

    def hash_file(path: Path) -> str:
        threads.add(threading.current_thread().name)
        return real_hash(path)

    monkeypatch.setattr(integrity, "hash_file", hash_file)
    verify_entries(tmp_path, entries, "marker")
    assert any(t.startswith("verify-read") for t in threads), threads  # the files were hashed by the pool

    _corrupt(tmp_path / "f09.bin")
    _corrupt(tmp_path / "f03.bin")
    for _ in range(5):  # whichever reader finishes first, the first file in list order is named
        with pytest.raises(VerificationError, match=r"f03\.bin: content differs from marker \(xxh3_128") as err:
            verify_entries(tmp_path, entries, "marker")
        assert "f09" not in str(err.value)


def test_parallel_verify_keeps_list_order_across_kinds_of_failure(tmp_path: Path) -> None:
    entries = _files(tmp_path, 8)
    _corrupt(tmp_path / "f02.bin")  # content differs
    (tmp_path / "f05.bin").write_bytes(b"short")  # size differs: found before any hashing, named only if first
    with pytest.raises(VerificationError, match=r"f02\.bin: content differs from marker"):
        verify_entries(tmp_path, entries, "marker")
    (tmp_path / "f01.bin").unlink()
    with pytest.raises(VerificationError, match=r"f01\.bin is listed in marker but missing"):
        verify_entries(tmp_path, entries, "marker")
    where = [f"rank_{i}.done.json" for i in range(len(entries))]
    with pytest.raises(VerificationError, match=r"f01\.bin is listed in rank_1\.done\.json but missing"):
        verify_entries(tmp_path, entries, where)
