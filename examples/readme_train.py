"""The README's training script (tests/test_install.py checks the two are the same and runs it)."""

import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.checkpoint import Checkpointer, RankRNG

logging.basicConfig(level=logging.INFO)  # the library says what it resumed from and what it committed
dist.init_process_group("gloo")  # torchrun sets the environment
rank, steps = dist.get_rank(), 40
torch.manual_seed(0)
model = DDP(torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = Checkpointer("runs/readme", every_steps=10, keep_last=2, keep_best=1)
state = {"model": model, "optim": opt, "rng": RankRNG(rank)}
start = ckpt.load_latest(into=state)  # 0, or the newest committed step (the same on every rank)
for step in range(start + 1, steps + 1):
    x = torch.randn(32, 16)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    stop = ckpt.reached_preemption(step)  # SLURM's USR2 on any rank: every rank stops at this step
    if ckpt.should_save(step) or step == steps or stop:
        ckpt.save(step, state, metrics={"loss": loss.item()})  # or ckpt.save_async(...)
    if stop:
        break
ckpt.close()  # the last step committed
