"""How long a checkpoint blocks training: pipeline sync shard-save vs pipeline async (``AsyncSaver``) vs torch's
``dcp.async_save``.

One process (a world-size-1 gloo group), a state of ``--size-mb`` (fp32 tensors of 8 MiB, on ``--device``: with
``cuda`` the async staging buffer is pinned). Per round and mode, training is "blocked" for:

* ``sync``: ``pipeline.checkpoint.save.rank_save.save_dcp`` (the library's and shard-save's save: DCP write with
  fsync + hashes + done-marker), all of it;
* ``async``: settling the previous save (``AsyncSaver.wait``) plus staging the state into the reused buffer
  (``AsyncSaver.start`` with ``rank_save.dcp_persist``); the writer then runs while "training" (a sleep of
  ``--gap-s``, default twice the sync save time of the warm-up) goes on;
* ``torch_async``: waiting for the previous ``dcp.async_save`` future plus the ``dcp.async_save`` call itself
  (default stager, a ``FileSystemWriter`` and a gloo group of its own), with the same gap.

The order of the modes rotates every round; an untimed warm-up round runs first; each save goes into a fresh
dir, the previous ones are deleted. Prints JSON: median blocked and persist seconds per mode and the ratios
``async / sync`` and ``torch_async / sync`` of the blocked times.

    .venv/bin/python bench/async_blocking.py                       # 256 MB on CPU, 3 rounds
    .venv/bin/python bench/async_blocking.py --size-mb 1024 --device cuda --rounds 5

``run(size_mb, rounds, device)`` returns the same dict (for a bench runner).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as bench/<name>.py

from pipeline.checkpoint.save import rank_save  # noqa: E402
from pipeline.checkpoint.save.async_save import AsyncSaver  # noqa: E402
from pipeline.storage.layout import CheckpointLayout  # noqa: E402

MiB = 1 << 20
MODES = ("sync", "async", "torch_async")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _state(size_mb: int, device: str) -> dict[str, Any]:
    per = 8 * MiB // 4
    n = max(1, size_mb // 8)
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(per, generator=gen).to(device) for i in range(n)}
    return {"model": model, "train": {"step": torch.tensor(1)}, "sched": {"last_epoch": 1}}


class _Bench:
    def __init__(self, root: Path, size_mb: int, device: str) -> None:
        threads = rank_save.auto_writer_threads(1)
        self.target = rank_save.RankTarget(
            CheckpointLayout(root / "out"), rank=0, world_size=1, attempt="b", writer_threads=threads
        )
        self.root = root
        self.state = _state(size_mb, device)
        self.pg = dist.new_group(backend="gloo")
        self.torch_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
        self.saver = AsyncSaver(0, self.pg, deadline_s=600, threads=threads)
        self.torch_future: Any = None
        self.step = 0

    def _next_step(self) -> int:
        self.step += 1
        for old in self.target.layout.staging.glob("step_*"):  # one checkpoint on disk at a time (plus the pending)
            if old.name not in (f"step_{self.step - 1}", f"step_{self.step}"):
                shutil.rmtree(old, ignore_errors=True)
        return self.step

    def sync(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        result = rank_save.save_dcp(self.target, self._next_step(), self.state, self.pg)
        if not result.ok:
            raise RuntimeError(f"sync save failed: {result.error}")
        took = time.perf_counter() - t0
        return took, took

    def async_(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        previous = self.saver.wait()
        if previous is not None and not previous.ok:
            raise RuntimeError(f"async save failed: {previous.error}")
        step = self._next_step()
        self.saver.start(step, self.state, rank_save.dcp_persist(self.target, step), waited_s=0.0)
        blocked = time.perf_counter() - t0
        return blocked, -1.0  # its persist time is known once settled (see settle_async)

    def settle_async(self) -> float:
        done = self.saver.wait()
        if done is None or not done.ok:
            raise RuntimeError(f"async save failed: {done}")
        return done.persist_s

    def torch_async(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        if self.torch_future is not None:
            self.torch_future.result()
        path = self.root / "torch" / f"step_{self._next_step()}"
        shutil.rmtree(self.root / "torch", ignore_errors=True)
        started = time.perf_counter()
        fut = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(str(path)), process_group=self.torch_pg)
        self.torch_future = getattr(fut, "upload_completion", fut)
        blocked = time.perf_counter() - t0
        self.torch_future.result()  # its persist time: measured here, outside the blocked time
        return blocked, time.perf_counter() - started


def run(size_mb: int = 256, rounds: int = 3, device: str = "cpu", gap_s: float | None = None) -> dict[str, Any]:
    """Median blocked and persist seconds per mode, and the blocked-time ratios to the sync save."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible")
    started_here = not dist.is_initialized()
    if started_here:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    scratch = Path(tempfile.mkdtemp(prefix="async_blocking_"))
    try:
        bench = _Bench(scratch, size_mb, device)
        warm_sync = bench.sync()[0]
        bench.async_()
        bench.settle_async()
        bench.torch_async()
        gap = gap_s if gap_s is not None else 2 * warm_sync
        blocked: dict[str, list[float]] = {m: [] for m in MODES}
        persist: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for mode in order:
                if mode == "sync":
                    b, p = bench.sync()
                elif mode == "async":
                    b, _ = bench.async_()
                    time.sleep(gap)  # "training" runs while the writer persists
                    p = bench.settle_async()
                else:
                    b, p = bench.torch_async()
                    time.sleep(gap)
                blocked[mode].append(b)
                persist[mode].append(p)
        med = {m: statistics.median(blocked[m]) for m in MODES}
        return {
            "size_mb": size_mb,
            "device": device,
            "rounds": rounds,
            "gap_s": round(gap, 3),
            "blocked_s": {m: round(v, 4) for m, v in med.items()},
            "persist_s": {m: round(statistics.median(persist[m]), 4) for m in MODES},
            "ratio_async_vs_sync": round(med["async"] / med["sync"], 4),
            "ratio_torch_async_vs_sync": round(med["torch_async"] / med["sync"], 4),
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if started_here:
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gap-s", type=float, default=None, help="simulated training between saves")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(run(args.size_mb, args.rounds, args.device, args.gap_s), indent=2))


if __name__ == "__main__":
    main()
