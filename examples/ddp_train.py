"""A plain DDP training script with checkpoints from the library: its own model, data loader and loop.

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --out runs/ddp
    python -m pipeline.status runs/ddp            # committed steps, latest, quarantine
    python -m pipeline.consolidate runs/ddp       # full tensors as safetensors

Kill it at any moment (a rank, torchrun, Ctrl-C) and run the same command again: it resumes from the newest
committed step with bit-identical losses. The lines marked ``# ckpt`` are all that checkpointing adds.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pipeline.checkpoint import Checkpointer, RankRNG  # ckpt


class Batches:
    """The user's own loader: a fixed synthetic regression set, each rank taking its share, resumable."""

    def __init__(self, rank: int, world: int, batch: int = 16, n: int = 4096, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 32, generator=g)
        self.y = self.x @ torch.randn(32, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
        self.rank, self.world, self.batch, self.pos = rank, world, batch, 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = (self.pos * self.world + self.rank) * self.batch
        idx = torch.arange(start, start + self.batch) % len(self.x)
        self.pos += 1
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = int(sd["pos"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint directory (created)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="save every N steps")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to watch or kill it)")
    p.add_argument("--storage", default=None, help="s3://bucket/prefix: checkpoints in a bucket (AWS env vars)")
    p.add_argument("--fast-every", type=int, default=None, help="also keep a fast copy every N steps (node-local)")
    p.add_argument("--fast-dir", default=None, help="node-local dir of the fast tier ({rank}, {node} filled in)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="{node} is rank // this (default: all local)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # the library's lines
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    data = Batches(rank, world)
    torch.manual_seed(1 + rank)  # dropout differs per rank; its generator is saved per rank

    node = rank // (args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    fast_dir = args.fast_dir.format(rank=rank, node=node) if args.fast_dir else None
    ckpt = Checkpointer(args.out, every_steps=args.every, keep_last=3, storage=args.storage,  # ckpt
                        fast_every=args.fast_every, fast_dir=fast_dir)  # fmt: skip  # ckpt
    state = {"model": model, "optim": opt, "sched": sched, "data": data, "rng": RankRNG(rank)}  # ckpt
    start = ckpt.load_latest(into=state)  # ckpt
    for step in range(start + 1, args.steps + 1):
        x, y = next(data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item() / world!r}", flush=True)
        time.sleep(args.sleep)
        stop = ckpt.reached_preemption(step)  # ckpt: SLURM's USR2, on every rank at the same step
        if ckpt.should_save(step) or step == args.steps or stop:  # ckpt
            ckpt.save(step, state)  # ckpt
        if ckpt.should_save_fast(step):  # ckpt: node-local and on a peer node, in the background
            ckpt.save_fast(step, state)  # ckpt
        if stop:  # ckpt
            break  # ckpt
    ckpt.close()  # ckpt: the committer commits the last step, every wait bounded
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C (torchrun passes it to every rank): what was committed stays
        if os.environ.get("RANK", "0") == "0":
            print("interrupted: the committed steps are kept; run the same command to resume", file=sys.stderr)
        sys.exit(130)
