"""What train's loop drives, per strategy: the wrapped model and optimizer, its checkpoint state, and its loads.

* :func:`build`: the model wrapped for DDP (``DistributedDataParallel``), FSDP2 (``fully_shard`` per decoder
  layer, then the root) or DeepSpeed ZeRO (an engine around a client ``torch.optim.AdamW``);
* :func:`dcp_state` / :func:`train_state`: the state a checkpoint holds, in the key schema of
  :mod:`pipeline.checkpoint.save.state` (``model``, ``optim``, ``sched``, ``train``, ``rng``);
* :func:`load_step`: a committed step into the trainer, by DCP when it was written as DCP at this world size
  (DCP reshards DDP/FSDP2 steps itself), else through its world-size-free form
  (:mod:`pipeline.checkpoint.save.portable`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from pipeline.checkpoint.fast.landing import Landing
from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.save.portable import TrainState, apply_native, open_portable
from pipeline.checkpoint.save.state import MODEL, OPTIM, RNG, SCHED, TRAIN, rng_key
from pipeline.config.schema import PipelineConfig, rank_batch_size
from pipeline.config.workload import TrainConfig
from pipeline.formats.dcp import FORMAT as DCP_FORMAT
from pipeline.formats.dcp import load_into
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import write_json_atomic
from pipeline.strategies import zero
from pipeline.workload.data import SampleStream, load_tokenizer
from pipeline.workload.model import base_model, build_model, fsdp_units, is_transformers, load_target, loss_of


@dataclass
class Trainer:
    """``net`` is called for the loss (DDP/FSDP2 module or DeepSpeed engine); ``train_step`` runs one optimizer
    step over a rank's batch (``train.grad_accum`` micro-batches, clipping, bf16 autocast under DDP)."""

    net: Any
    module: torch.nn.Module
    opt: torch.optim.Optimizer
    train: TrainConfig
    engine: Any = None
    autocast: bool = False
    loss_fn: Callable[..., torch.Tensor] | None = None

    @property
    def format(self) -> str:
        return DCP_FORMAT if self.engine is None else zero.format_name(self.engine.zero_optimization_stage())

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        device = batch.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.autocast):
            if self.loss_fn is not None:
                return self.loss_fn(self.net, batch)
            return loss_of(self.net, batch)

    def train_step(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward, backward and the optimizer step; returns the batch's mean loss (detached)."""
        accum = self.train.grad_accum
        total = torch.zeros((), device=batch.device)
        for micro in batch.chunk(accum):
            loss = self.loss(micro)
            if self.engine is not None:  # DeepSpeed scales by its accumulation steps and steps at the boundary
                self.engine.backward(loss)
                self.engine.step()
            else:
                (loss / accum).backward()
            total += loss.detach().float()
        if self.engine is None:
            if self.train.grad_clip is not None:
                params = [p for p in self.module.parameters() if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(params, self.train.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return total / accum


def make_optimizer(params: list[torch.nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    if train.optimizer == "sgd":
        return torch.optim.SGD(params, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)


def lr_factor(train: TrainConfig, step: int) -> float:
    """The schedule's multiplier of ``train.lr`` for the 0-based optimizer step ``step``."""
    warmup = max(1, train.warmup_steps)
    if step < warmup or train.schedule == "constant":
        return min(1.0, (step + 1) / warmup)
    progress = min(1.0, (step + 1 - warmup) / max(1, train.steps - warmup))
    if train.schedule == "linear":
        return 1.0 - (1.0 - train.min_lr_ratio) * progress
    return train.min_lr_ratio + (1.0 - train.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_schedule(opt: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    # A plain function, not a functools.partial: LambdaLR's state dict stores a callable object's __dict__ (an
    # empty dict, which DCP's flattening drops, so a world-size-free load would miss the key); a function: None.
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(train, step))


def _wrap(model: torch.nn.Module, cfg: PipelineConfig, device: torch.device) -> torch.nn.Module:
    model.to(device)
    units = fsdp_units(model)
    if cfg.train.activation_checkpointing:
        if is_transformers(model):
            enable: Any = base_model(model).gradient_checkpointing_enable
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            for unit in units or [model]:
                checkpoint(unit)
    if cfg.strategy.name == "fsdp2":
        mp = MixedPrecisionPolicy()  # fp32: no casts
        if cfg.strategy.precision == "bf16":  # compute in bf16; master weights and gradient reduction in fp32
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in units:
            fully_shard(unit, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def build(cfg: PipelineConfig, layout: RunLayout, device: torch.device, world: int) -> Trainer:
    model = build_model(cfg.model, load_tokenizer(layout.assets))
    hook = cfg.train.step
    loss_fn = None
    if hook._target_:
        loss_fn = functools.partial(load_target(hook._target_, "train.step._target_"), **hook.args)
    if cfg.strategy.name == "deepspeed":
        batch = rank_batch_size(cfg.train, world)
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg.train)
        accum = cfg.train.grad_accum
        engine = zero.build_engine(model, cfg.strategy, opt, batch // accum, accum, cfg.train.grad_clip)
        return Trainer(net=engine, module=engine.module, opt=opt, train=cfg.train, engine=engine, loss_fn=loss_fn)
    wrapped = _wrap(model, cfg, device)
    opt = make_optimizer([p for p in wrapped.parameters() if p.requires_grad], cfg.train)
    autocast = cfg.strategy.name == "ddp" and cfg.strategy.precision == "bf16"
    return Trainer(net=wrapped, module=wrapped, opt=opt, train=cfg.train, autocast=autocast, loss_fn=loss_fn)


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
        return _apply_dcp_state(trainer, state)
    portable = open_portable(step_dir, manifest)
    try:
        if trainer.engine is not None:
            zero.load_portable(trainer.engine, trainer.opt, portable, trainer.engine.zero_optimization_stage())
        else:
            apply_native(trainer.module, trainer.opt, portable)
        return portable.train
    finally:
        portable.close()


def fast_landing(
    trainer: Trainer, sched: Any, stream: SampleStream, rank: int, loaded: Callable[[TrainState], int]
) -> Landing:
    """Where a fast-tier copy of this rank's state (same world size and layout) goes: ``trainer``'s model and
    optimizer; ``loaded`` gets the rest of the training state and returns its step."""
    return Landing(
        lambda: dcp_state(trainer, sched, stream, 0, rank),
        lambda state: loaded(_apply_dcp_state(trainer, state)),
        f"rank {rank}'s fast copy",
        trainer.opt,
    )


def _apply_dcp_state(trainer: Trainer, state: dict[str, Any]) -> TrainState:
    """A loaded :func:`dcp_state` into ``trainer`` (model and optimizer by name); the rest returned."""
    set_state_dict(trainer.module, trainer.opt, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM])
    return TrainState(
        step=int(state[TRAIN]["step"]),
        data_epoch=int(state[TRAIN]["data_epoch"]),
        data_offset=int(state[TRAIN]["data_offset"]),
        sched=state[SCHED],
        rng=state.get(RNG, {}),
    )


PROBE_TOKENS = 16


def write_probe(trainer: Trainer, stream: SampleStream, device: torch.device, path: str, rank: int) -> None:
    """Every rank computes (ZeRO-3 and FSDP2 gather their shards); rank 0 writes (tests only: the train stage's
    ``PROBE_ENV``)."""
    probe = probe_logits(trainer, stream, device)
    if rank == 0:
        write_json_atomic(Path(path), probe)


def probe_logits(trainer: Trainer, stream: SampleStream, device: torch.device) -> dict[str, object]:
    """The trained model's logits on a fixed probe (the corpus' first sample), as the training engine computes
    them (every rank takes part: ZeRO-3 and FSDP2 gather their shards): what an export must reproduce."""
    ids = stream.first_sample()[:PROBE_TOKENS].unsqueeze(0).to(device)
    trainer.net.eval()  # dropout off, as the exported model is used
    with torch.no_grad():
        out = trainer.net(input_ids=ids)
        logits = (out if isinstance(out, torch.Tensor) else out.logits).float().cpu()
    trainer.net.train()
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
