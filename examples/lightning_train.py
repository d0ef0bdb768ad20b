"""A PyTorch Lightning run whose checkpoints are committed (docs/trainers.md): a small MLP on fixed random data,
``torchrun --nproc-per-node 2 examples/lightning_train.py --out runs/lit``. Rerun the same command after a kill:
``fit(ckpt_path="last")`` resumes from the newest committed step, mid-epoch too (the loader is torchdata's
``StatefulDataLoader``, whose position Lightning saves). Rank 0 appends each step's loss (the mean over the
ranks) to ``<out>/losses.jsonl``, so a resumed run can be compared with an uninterrupted one.

``--strategy fsdp2``: Lightning's ``ModelParallelStrategy``, the module sharded with FSDP2's ``fully_shard`` in
``configure_model``; its weights and optimizer state are saved sharded, each rank its own shards.
``--ckpt best`` or ``--ckpt <out>/checkpoints/step_N``: resume from the best committed step, or that one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.io import AsyncCheckpointIO
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

from pipeline.integrations.lightning import CommittedCheckpoint


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``: each linear layer and the whole net sharded over the data-parallel ranks."""
        if self.device_mesh is not None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)  # the mean over the ranks: what best-k ranks by
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)}


class LogLosses(pl.Callback):
    def __init__(self, path: str, pause_s: float) -> None:
        self.path, self.pause_s = path, pause_s

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                loss = float(trainer.callback_metrics["train_loss"])
                f.write(json.dumps({"step": trainer.global_step, "loss": loss}) + "\n")
        time.sleep(self.pause_s)  # slow enough for a test to kill a rank mid-run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--keep", type=int, default=2, help="save_top_k")
    p.add_argument("--keep-by", default="step", help="step: keep the newest --keep steps; train_loss: the best")
    p.add_argument("--async-save", action="store_true", help="Lightning's AsyncCheckpointIO plugin")
    p.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp", help="fsdp2: ModelParallelStrategy")
    p.add_argument("--ckpt", default="last", help="fit's ckpt_path: last, best or a committed step's directory")
    p.add_argument("--pause", type=float, default=float(os.environ.get("EXAMPLE_STEP_PAUSE_S", "0")))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(160, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.3 * torch.randn(160, 1, generator=g)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    dataset = torch.utils.data.TensorDataset(x, y)
    # The sampler given, not Lightning's: with shuffle=True Lightning wraps the loader's own RandomSampler, whose
    # order comes from the global generator, which no resume restores. DistributedSampler's comes from seed+epoch.
    sampler = torch.utils.data.DistributedSampler(dataset, world, rank, shuffle=True, seed=0)
    data = StatefulDataLoader(dataset, batch_size=4, sampler=sampler)
    checkpoint = CommittedCheckpoint(
        dirpath=a.out, every_n_train_steps=a.every, save_top_k=a.keep, monitor=a.keep_by,
        mode="max" if a.keep_by == "step" else "min", save_last=True,
    )  # fmt: skip
    strategy: Any = "ddp" if world > 1 else "auto"
    if a.strategy == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_steps=a.steps,
        callbacks=[checkpoint, LogLosses(os.path.join(a.out, "losses.jsonl"), a.pause)],
        plugins=[AsyncCheckpointIO()] if a.async_save else None, logger=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, deterministic=True, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(Regression(), data, ckpt_path=a.ckpt)  # "last": the newest committed step, or from scratch


if __name__ == "__main__":
    main()
