"""DDP with a ``torchdata`` ``StatefulDataLoader`` (shuffled) checkpointed by the library, resumed exactly.

    pip install -e '.[data]'     # torchdata (scripts/setup.sh installs it)
    torchrun --standalone --nproc-per-node 2 examples/loader_train.py --out runs/loader

Stop it at any step and run the same command again: the loader resumes at the batch after the committed step,
in the same shuffled order, and the losses are those of an uninterrupted run. Two things make it exact:

* the loader is per-rank state, so it goes under ``RankLocal(loader, rank)``;
* its shuffle has a generator of its own, given to the sampler (torchdata's stateful ``RandomSampler``), not
  to the loader. Without one, the sampler seeds itself from the global torch generator, which ``RankRNG``
  restores to another state than the one the epoch began with; and a generator passed as
  ``StatefulDataLoader(..., shuffle=True, generator=g)`` also draws each epoch's base seed, which torchdata 0.11
  does not replay on load, so the epoch after the resumed one is shuffled differently (measured: steps 11-12
  equal, 13 on differ).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from pipeline.checkpoint import Checkpointer, RankLocal, RankRNG  # ckpt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint directory (created)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4, help="save every N steps")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=g)  # a small set: the loader goes through several epochs
    y = x @ torch.randn(16, 1, generator=g)
    mine = TensorDataset(x[rank::world], y[rank::world])  # this rank's share
    # the shuffle's own generator, apart from the loader's (whose draws for worker seeds would shift it)
    order = RandomSampler(mine, generator=torch.Generator().manual_seed(rank))
    loader = StatefulDataLoader(mine, batch_size=8, sampler=order)
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = Checkpointer(args.out, every_steps=args.every)  # ckpt
    state = {"model": model, "optim": opt, "loader": RankLocal(loader, rank), "rng": RankRNG(rank)}  # ckpt
    start = ckpt.load_latest(into=state)  # ckpt
    batches = iter(loader)
    for step in range(start + 1, args.steps + 1):
        try:
            xb, yb = next(batches)
        except StopIteration:  # a new epoch: a new shuffle, drawn from the loader's own generator
            batches = iter(loader)
            xb, yb = next(batches)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item() / world!r}", flush=True)
        if ckpt.should_save(step) or step == args.steps:  # ckpt
            ckpt.save(step, state)  # ckpt
    ckpt.close()  # ckpt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
