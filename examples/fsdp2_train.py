"""An FSDP2 training script with checkpoints from the library: its own model, data loader and loop.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_train.py --out runs/fsdp2
    python -m pipeline.status runs/fsdp2
    python -m pipeline.consolidate runs/fsdp2     # FSDP2's shards joined into full tensors

Each rank saves only its own shards (DCP), and a step resumes at another world size too (DCP reshards). The
lines marked ``# ckpt`` are all that checkpointing adds.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from pipeline.checkpoint import Checkpointer  # ckpt


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.ff = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class TinyLM(torch.nn.Module):
    """The user's own model: embeddings, residual blocks, a tied output head."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return h @ self.embed.weight.T


class Tokens:
    """The user's own loader: a counting-pattern token stream, each rank taking its share, resumable."""

    def __init__(self, rank: int, world: int, batch: int = 8, seq: int = 16, vocab: int = 64) -> None:
        self.rank, self.world, self.batch, self.seq, self.vocab, self.pos = rank, world, batch, seq, vocab, 0

    def __next__(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.pos * self.world + self.rank)
        self.pos += 1
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=g)
        return (start + torch.arange(self.seq + 1)) % self.vocab

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
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = Tokens(rank, world)

    ckpt = Checkpointer(args.out, every_steps=args.every, keep_last=3)  # ckpt
    state = {"model": model, "optim": opt, "data": data}  # ckpt
    start = ckpt.load_latest(into=state)  # ckpt
    for step in range(start + 1, args.steps + 1):
        ids = next(data)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item() / world!r}", flush=True)
        time.sleep(args.sleep)
        stop = ckpt.reached_preemption(step)  # ckpt
        if ckpt.should_save(step) or step == args.steps or stop:  # ckpt
            ckpt.save(step, state)  # ckpt
        if stop:  # ckpt
            break  # ckpt
    ckpt.close()  # ckpt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
