"""The library's save from a plain training loop, against torch's ``dcp.save`` / ``dcp.async_save``, same run.

Two ranks (gloo, spawned here), a plain DDP loop around an MLP of ``--size-mb`` fp32 parameters with AdamW (so
the state is about 3x that), training ``--gap-steps`` steps between saves. Per round and mode, the time training
is blocked by one save:

* ``lib_sync``: ``Checkpointer.save`` (DCP files hashed while written and fsync'd, a done-marker, the outcome
  agreed by every rank); the rank-0 committer thread verifies and publishes in the background;
* ``dcp_sync``: ``dcp.save`` of the same ``get_state_dict`` state with a default ``FileSystemWriter``;
* ``lib_async``: ``Checkpointer.save_async`` (settling the previous one, staging into the reused buffer);
* ``dcp_async``: waiting for the previous ``dcp.async_save`` future plus the ``dcp.async_save`` call.

Modes rotate every round after an untimed warm-up; each save goes to a fresh dir (``keep_last=2`` for the
library, older torch dirs deleted). Prints JSON: median blocked seconds per mode (slowest rank) and the ratios
``lib_sync / dcp_sync`` and ``lib_async / dcp_async``.

    .venv/bin/python bench/library_save.py                 # 128 MB of parameters, 3 rounds
    .venv/bin/python bench/library_save.py --size-mb 256 --rounds 5

``run(size_mb, rounds)`` returns the same dict (for bench/run.py).
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as bench/<name>.py

from pipeline.checkpoint import Checkpointer  # noqa: E402

MODES = ("lib_sync", "dcp_sync", "lib_async", "dcp_async")
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Loop:
    """One rank's training loop and its four ways of saving."""

    def __init__(self, rank: int, root: Path, size_mb: int, gap_steps: int) -> None:
        self.rank, self.root, self.gap_steps, self.step = rank, root, gap_steps, 0
        self.width = 1024
        self.layers = max(1, size_mb * (1 << 20) // 4 // (self.width * self.width))
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(self.width, self.width) for _ in range(self.layers)])
        self.model = DistributedDataParallel(net)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.lib = Checkpointer(root / "lib", keep_last=2, deadline_s=600)
        self.torch_pg = dist.new_group(backend="gloo")
        self.state = {"model": self.model, "optim": self.opt}
        self.future: Any = None

    def train(self) -> None:
        for _ in range(self.gap_steps):
            self.step += 1
            loss = self.model(torch.randn(8, self.width)).square().mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()

    def save(self, mode: str) -> float:
        """Blocked seconds of one save (the slowest rank's)."""
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "lib_sync":
            self.lib.save(self.step, self.state)
        elif mode == "lib_async":
            self.lib.save_async(self.step, self.state)
        else:
            if self.future is not None:
                self.future.result()
            msd, osd = get_state_dict(self.model, self.opt)
            writer = dcp.FileSystemWriter(str(self.root / "torch" / f"step_{self.step}"))
            sd = {"model": msd, "optim": osd}
            if mode == "dcp_sync":
                dcp.save(sd, storage_writer=writer, process_group=self.torch_pg)
            else:
                fut = dcp.async_save(sd, storage_writer=writer, process_group=self.torch_pg)
                self.future = getattr(fut, "upload_completion", fut)
        worst = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return float(worst.item())

    def settle(self) -> None:
        self.lib.wait()
        if self.future is not None:
            self.future.result()
            self.future = None
        if self.rank == 0:
            for old in sorted((self.root / "torch").glob("step_*"))[:-1]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()


def _worker(rank: int, port: int, root: str, size_mb: int, rounds: int, gap_steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    loop = _Loop(rank, Path(root), size_mb, gap_steps)
    blocked: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds + 1):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for mode in order:
            loop.train()
            took = loop.save(mode)
            loop.train()  # the async writers run while training goes on
            loop.settle()
            if r > 0:
                blocked[mode].append(took)
    loop.lib.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"blocked": blocked, "layers": loop.layers, "width": loop.width}))
    dist.destroy_process_group()


def run(size_mb: int = 128, rounds: int = 3, gap_steps: int = 2) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="library_save-"))
    try:
        out = root / "result.json"
        args = (_free_port(), str(root), size_mb, rounds, gap_steps, str(out))
        mp.start_processes(_worker, args=args, nprocs=WORLD, start_method="spawn")
        raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {m: statistics.median(v) for m, v in raw["blocked"].items()}
    params_mb = raw["layers"] * raw["width"] * (raw["width"] + 1) * 4 / (1 << 20)
    return {
        "config": {"size_mb": size_mb, "params_mb": round(params_mb, 1), "rounds": rounds, "ranks": WORLD},
        "blocked_s": {m: round(v, 4) for m, v in median.items()},
        "rounds_s": raw["blocked"],
        "ratio_lib_sync_to_dcp_sync": round(median["lib_sync"] / median["dcp_sync"], 3),
        "ratio_lib_async_to_dcp_async": round(median["lib_async"] / median["dcp_async"], 3),
        "ratio_lib_async_to_lib_sync": round(median["lib_async"] / median["lib_sync"], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=128, help="fp32 parameters in MB (state is ~3x with AdamW)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gap-steps", type=int, default=2, help="training steps between a save and the next")
    a = p.parse_args()
    print(json.dumps(run(a.size_mb, a.rounds, a.gap_steps), indent=2))


if __name__ == "__main__":
    main()
