"""What train's loop drives, per strategy: the wrapped model and optimizer, its checkpoint state, and its loads.

* :func:`build`: the model wrapped for DDP (``DistributedDataParallel``), FSDP2 (``fully_shard`` per decoder
  layer, then the root) or DeepSpeed ZeRO (an engine around a client ``torch.optim.AdamW``);
* :func:`dcp_state` / :func:`train_state`: the state a checkpoint holds, in the key schema of
  :mod:`pipeline.checkpoint.state` (``model``, ``optim``, ``sched``, ``train``, ``rng``);
* :func:`load_step`: a committed step into the trainer, by DCP when it was written as DCP at this world size
  (DCP reshards DDP/FSDP2 steps itself), else through its world-size-free form (:mod:`pipeline.checkpoint.portable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.portable import TrainState, apply_native, open_portable
from pipeline.checkpoint.state import MODEL, OPTIM, RNG, SCHED, TRAIN, rng_key
from pipeline.config.schema import PipelineConfig, rank_batch_size
from pipeline.formats.dcp import FORMAT as DCP_FORMAT
from pipeline.formats.dcp import load_into
from pipeline.storage.layout import RunLayout
from pipeline.strategies import zero
from pipeline.workload.data import SampleStream, load_tokenizer
from pipeline.workload.model import build_model


@dataclass
class Trainer:
    """``net`` is called for the loss (DDP/FSDP2 module or DeepSpeed engine)."""

    net: Any
    module: torch.nn.Module
    opt: torch.optim.Optimizer
    engine: Any = None

    @property
    def format(self) -> str:
        return DCP_FORMAT if self.engine is None else zero.format_name(self.engine.zero_optimization_stage())

    def step(self, loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(loss)
            self.engine.step()  # also zeroes the gradients
            return
        loss.backward()
        self.opt.step()

    def zero_grad(self) -> None:
        if self.engine is None:
            self.opt.zero_grad(set_to_none=True)


def _wrap(model: torch.nn.Module, cfg: PipelineConfig, device: torch.device) -> torch.nn.Module:
    model.to(device)
    if cfg.strategy.name == "fsdp2":
        for layer in model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def build(cfg: PipelineConfig, layout: RunLayout, device: torch.device, world: int) -> Trainer:
    model = build_model(cfg.model, load_tokenizer(layout.assets))
    if cfg.strategy.name == "deepspeed":
        batch = rank_batch_size(cfg.train, world)
        engine, opt = zero.build_engine(model, cfg.strategy, batch, cfg.train.lr, cfg.train.weight_decay)
        return Trainer(net=engine, module=engine.module, opt=opt, engine=engine)
    wrapped = _wrap(model, cfg, device)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    return Trainer(net=wrapped, module=wrapped, opt=opt)


def rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's generators: CPU under ``rank_K``, its GPU's under ``rank_K_cuda``."""
    rng = {rng_key(rank): torch.get_rng_state()}
    if device.type == "cuda":
        rng[rng_key(rank, cuda=True)] = torch.cuda.get_rng_state(device)
    return rng


def restore_rng(rng: dict[str, torch.Tensor], rank: int, device: torch.device) -> bool:
    """Restore this rank's generators; False when the step has none for this rank (another world size)."""
    if rng_key(rank) not in rng or (device.type == "cuda" and rng_key(rank, cuda=True) not in rng):
        return False
    torch.set_rng_state(rng[rng_key(rank)])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng[rng_key(rank, cuda=True)], device)
    return True


def dcp_state(trainer: Trainer, sched: Any, stream: SampleStream, step: int, rank: int) -> dict[str, Any]:
    """The DCP state dict of a DDP/FSDP2 checkpoint."""
    msd, osd = get_state_dict(trainer.module, trainer.opt)
    device = next(trainer.module.parameters()).device  # FSDP2's DTensors report their local device
    return {
        MODEL: msd,
        OPTIM: osd,
        SCHED: sched.state_dict(),
        TRAIN: {
            "step": torch.tensor(step),
            "data_epoch": torch.tensor(stream.pos.epoch),
            "data_offset": torch.tensor(stream.pos.offset),
        },
        RNG: rng_state(rank, device),
    }


def train_state(sched: Any, stream: SampleStream, step: int, rank: int, device: torch.device) -> TrainState:
    """Everything but model and optimizer, for DeepSpeed steps (written as JSON beside DeepSpeed's files)."""
    return TrainState(step, stream.pos.epoch, stream.pos.offset, sched.state_dict(), rng_state(rank, device))


def load_step(
    trainer: Trainer,
    sched: Any,
    stream: SampleStream,
    step_dir: Path,
    manifest: Manifest,
    rank: int,
    world: int,
    pg: Any,
) -> TrainState:
    """Model and optimizer state into ``trainer``; the rest of the step's training state is returned."""
    if manifest.format == DCP_FORMAT and trainer.engine is None:  # DCP reshards DDP/FSDP2 steps itself
        state = dcp_state(trainer, sched, stream, 0, rank)
        if manifest.world_size != world:
            del state[RNG]  # the generators of ranks that no longer exist (or not yet) are not carried
        load_into(state, step_dir, process_group=pg)
        set_state_dict(trainer.module, trainer.opt, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM])
        return TrainState(
            step=int(state[TRAIN]["step"]),
            data_epoch=int(state[TRAIN]["data_epoch"]),
            data_offset=int(state[TRAIN]["data_offset"]),
            sched=state[SCHED],
            rng=state.get(RNG, {}),
        )
    portable = open_portable(step_dir, manifest)
    try:
        if trainer.engine is not None:
            zero.load_portable(trainer.engine, trainer.opt, portable, trainer.engine.zero_optimization_stage())
        else:
            apply_native(trainer.module, trainer.opt, portable)
        return portable.train
    finally:
        portable.close()


PROBE_TOKENS = 16


def probe_logits(trainer: Trainer, stream: SampleStream, device: torch.device) -> dict[str, object]:
    """The trained model's logits on a fixed probe (the corpus' first sample), as the training engine computes
    them (every rank takes part: ZeRO-3 and FSDP2 gather their shards): what an export must reproduce."""
    ids = stream.samples[0, :PROBE_TOKENS].unsqueeze(0).to(device)
    with torch.no_grad():
        logits = trainer.net(input_ids=ids).logits.float().cpu()
    return {"input_ids": ids.cpu().flatten().tolist(), "shape": list(logits.shape), "logits": logits.flatten().tolist()}


def global_mean(loss: torch.Tensor, world: int) -> float:
    """The step's loss over the global batch (every rank's batch is equally large): the same number at any world
    size for the same global batch, so loss curves compare across world sizes and strategies."""
    total = loss.float().reshape(1).clone()
    dist.all_reduce(total)
    return float(total.item()) / world


def any_rank(flag: bool, group: Any) -> bool:
    """True on every rank if ``flag`` is true on any (all ranks stop at the same step)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
