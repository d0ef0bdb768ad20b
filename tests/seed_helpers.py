"""Helpers for ``test_seeds.py``: start "ranks" as real processes at the same moment, and the rank bodies.

Each rank body is a module-level function ``body(rank, world, barrier, *args)`` (importable, so the ``spawn``
start method works too). A body calls :func:`sync` where the ranks must line up, like ``dist.barrier()``.
:func:`run_ranks` reports, per rank, either the body's return value or the exception it raised; it never
hangs: every barrier wait and every result has a deadline, and stragglers are killed.

The ``unguarded_*`` bodies reproduce the seed reports' patterns; the ``pipeline_*`` bodies do what the
pipeline does in the same situation (rank-private paths under a run dir fixed by the launching process).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.checkpoint.manifest import Marker, marker_path, write_marker
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import clear_file, write_bytes_atomic
from pipeline.storage.integrity import describe

# fork: cheap and truly simultaneous; SEED_TESTS_START_METHOD=spawn checks that nothing relies on inherited state.
START_METHOD = os.environ.get("SEED_TESTS_START_METHOD") or (
    "fork" if "fork" in mp.get_all_start_methods() else "spawn"
)
BARRIER_TIMEOUT_S = 20.0
TEST_FORMAT = "test-bytes"


@dataclass(frozen=True)
class RankResult:
    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None


def sync(barrier: Any) -> None:
    """``dist.barrier()`` for the test ranks, with a deadline so a dead rank cannot hang the others."""
    barrier.wait(BARRIER_TIMEOUT_S)


def _entry(body: Any, rank: int, *, world: int, barrier: Any, results: Any, kwargs: dict[str, Any]) -> None:
    try:
        value = body(rank, world, barrier, **kwargs)
    except BaseException as e:  # report every failure, including the ones under test
        results.put((rank, None, type(e).__name__, str(e)))
    else:
        results.put((rank, value, None, None))


def run_ranks(body: Any, world: int, *, timeout_s: float = 30.0, **kwargs: Any) -> list[RankResult]:
    """Run ``body`` in ``world`` processes; return one :class:`RankResult` per rank, in rank order."""
    ctx = mp.get_context(START_METHOD)
    barrier = ctx.Barrier(world)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry,
            args=(body, rank),
            kwargs={"world": world, "barrier": barrier, "results": results, "kwargs": kwargs},
            daemon=True,
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, value, error_type, error = results.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world)) - set(got))
                raise TimeoutError(f"rank(s) {missing} reported nothing within {timeout_s:g}s") from None
            got[rank] = RankResult(rank, value, error_type, error)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.join_thread()
    return [got[r] for r in range(world)]


def shard_bytes(step: int, rank: int, name: str) -> bytes:
    """Deterministic payload, so a reader can tell whose file it got."""
    return f"step={step} rank={rank} file={name}\n".encode() * 256


def _write_marker_for(staged: Path, *, step: int, rank: int, world: int, attempt: str, rels: list[str]) -> None:
    entries = tuple(describe(staged, rel) for rel in rels)
    write_marker(
        staged, Marker(step=step, rank=rank, world_size=world, format=TEST_FORMAT, attempt=attempt, files=entries)
    )


def stage_rank(layout: RunLayout, step: int, rank: int, *, world: int, attempt: str, marker: bool = True) -> list[str]:
    """What shard-save does on one rank, minus DCP: own files into the staged step, then the done-marker last."""
    staged = layout.staged_step(step)
    staged.mkdir(parents=True, exist_ok=True)  # idempotent mkdir of a planned dir: safe from every rank
    clear_file(marker_path(staged, rank))
    rels = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
    for rel in rels:
        write_bytes_atomic(staged / rel, shard_bytes(step, rank, rel))
    if marker:
        _write_marker_for(staged, step=step, rank=rank, world=world, attempt=attempt, rels=rels)
    return rels


# --- seed 002: --overwrite makes every rank rmtree + recreate the checkpoint dir -------------------------------


def unguarded_overwrite(rank: int, world: int, barrier: Any, *, ckpt_dir: str) -> str:
    """Seed 002 as reported: every DDP rank runs the checkpoint-dir set-up with ``--overwrite``."""
    sync(barrier)
    if os.path.exists(ckpt_dir):
        shutil.rmtree(ckpt_dir)
    os.makedirs(ckpt_dir)
    return ckpt_dir


def pipeline_stage_after_prepare(
    rank: int, world: int, barrier: Any, *, run_dir: str, step: int, attempt: str
) -> list[str]:
    """After prepare-dirs (the one deleting task) finished: ranks only mkdir(exist_ok) and write their own files."""
    sync(barrier)
    layout = RunLayout(Path(run_dir))
    own = layout.staged_step(step) / f"rank_{rank}"
    own.mkdir(parents=True, exist_ok=True)
    rel = f"rank_{rank}/shard.bin"
    write_bytes_atomic(layout.staged_step(step) / rel, shard_bytes(step, rank, rel))
    _write_marker_for(layout.staged_step(step), step=step, rank=rank, world=world, attempt=attempt, rels=[rel])
    return [rel]


# --- seed 000: every rank copytree()s its offload dir into one shared destination ------------------------------


def make_offload_dir(src: Path, rank: int, n_files: int = 4) -> list[str]:
    src.mkdir(parents=True, exist_ok=True)
    names = [f"tensor_{rank}_{i}.tensor.swp" for i in range(n_files)]
    for name in names:
        (src / name).write_bytes(shard_bytes(0, rank, name))
    return names


def unguarded_copytree_shared(rank: int, world: int, barrier: Any, *, offload_root: str, shared_dst: str) -> list[str]:
    """Seed 000 as reported: at save time all ranks ``copytree`` their NVMe offload dir into one shared dir."""
    src = Path(offload_root) / f"rank_{rank}"
    names = make_offload_dir(src, rank)
    sync(barrier)
    shutil.copytree(src, shared_dst)
    return names


def pipeline_copy_into_own_path(
    rank: int, world: int, barrier: Any, *, offload_root: str, run_dir: str, step: int, attempt: str
) -> list[str]:
    """Each rank copies only into its own path of the staged step, then writes its done-marker last."""
    src = Path(offload_root) / f"rank_{rank}"
    make_offload_dir(src, rank)
    sync(barrier)
    staged = RunLayout(Path(run_dir)).staged_step(step)
    staged.mkdir(parents=True, exist_ok=True)
    dst = staged / f"rank_{rank}" / "offloaded_tensors"
    shutil.copytree(src, dst)  # a rank-private destination: no other rank ever creates it
    rels = sorted(str(p.relative_to(staged)) for p in dst.rglob("*") if p.is_file())
    _write_marker_for(staged, step=step, rank=rank, world=world, attempt=attempt, rels=rels)
    return rels


# --- seed 001: each rank computes its own timestamped output dir -----------------------------------------------


def unguarded_timestamped_save(rank: int, world: int, barrier: Any, *, base: str, stagger_s: float) -> str:
    """Seed 001 as reported: ``output_dir`` ends in a per-process timestamp (…193345, …193346, …193347)."""
    sync(barrier)
    time.sleep(rank * stagger_s)  # ranks reach the save a little apart, as they do in real jobs
    out = Path(base) / f"sft-{time.strftime('%Y-%m-%d-%H%M%S')}" / "_dcp_tmp"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"__{rank}_0.distcp").write_bytes(shard_bytes(0, rank, "distcp"))
    sync(barrier)  # dist.barrier() after dcp.save
    if rank == 0:  # rank 0 converts to a single file: it reads every rank's shard from *its* dir
        for r in range(world):
            (out / f"__{r}_0.distcp").read_bytes()
    return str(out.parent)


def pipeline_given_run_dir_save(
    rank: int, world: int, barrier: Any, *, run_dir: str, step: int, attempt: str, stagger_s: float
) -> dict[str, Any]:
    """The run dir was fixed by the launching process and handed down; the ranks never derive a path."""
    sync(barrier)
    time.sleep(rank * stagger_s)  # the same stagger as the unguarded run: the clock no longer matters
    layout = RunLayout(Path(run_dir))
    rels = stage_rank(layout, step, rank, world=world, attempt=attempt)
    sync(barrier)
    found: dict[str, int] = {}
    if rank == 0:
        staged = layout.staged_step(step)
        for r in range(world):
            found[f"__{r}_0.distcp"] = len((staged / f"__{r}_0.distcp").read_bytes())
    return {"staged": str(layout.staged_step(step)), "files": rels, "found": found}
