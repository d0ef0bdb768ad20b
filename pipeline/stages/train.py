"""train: N tasks (``strategy.world_size``), DDP or FSDP2 over gloo (CPU) or NCCL (GPU).

Inputs: ``assets/`` (tokenizer, tokens) and, when resuming, the committed step named by ``checkpoints/latest``
— read by rank 0 only, verified against its manifest and broadcast to all ranks (ranks never each scan).
Outputs: staged checkpoints every ``checkpoint.every`` steps and at the last step, through shard-save
(model, optimizer, LR scheduler, step, data position, RNG state of every rank).
Owner: each rank writes only its own staged files and marker; nothing is committed here.
Done-marker: the last step (``train.steps``, or ``train.stop_after_step``) is committed, or staged with every
rank's marker from the current attempt.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from pipeline.checkpoint.manifest import read_latest, read_marker, verify_committed
from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError, VerificationError
from pipeline.formats.dcp import load_into
from pipeline.orchestration.contract import Resources, StageContract, TaskContext
from pipeline.stages import shard_save
from pipeline.storage.layout import RunLayout
from pipeline.strategies.process_group import broadcast_from_rank0, init_distributed
from pipeline.workload.data import DataPosition, SampleStream, load_tokenizer
from pipeline.workload.model import build_model

CONTRACT = StageContract(
    name="train",
    needs=("prepare_dirs",),
    reads="assets/, checkpoints/latest (resume step, decided by rank 0 and broadcast)",
    produces="checkpoints/staging/step_N/ via shard-save",
    marker="final step committed, or staged with all rank markers",
    distributed=True,
    resources=Resources(cpus_per_task=1, mem_gb=4, timeout_min=120),
)

log = logging.getLogger(__name__)


def final_step(cfg: PipelineConfig) -> int:
    stop = cfg.train.stop_after_step
    return cfg.train.steps if stop is None else min(stop, cfg.train.steps)


def is_save_step(cfg: PipelineConfig, step: int) -> bool:
    return step % cfg.checkpoint.every == 0 or step == cfg.train.steps or step == final_step(cfg)


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    if not (layout.assets / "assets.json").exists():
        raise PipelineError(f"{layout.assets} is not prepared: run stage=prepare_dirs for run {layout.run_id} first")


def _latest_step(layout: RunLayout) -> int:
    try:
        latest = read_latest(layout)
    except (VerificationError, OSError, ValueError):
        return -1
    return latest.step if latest else 0


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    target = final_step(cfg)
    if _latest_step(layout) >= target:
        return f"step {target} is committed"
    if (layout.committed_step(target) / "manifest.json").exists():
        return f"step {target} is published (verify_manifest moves latest)"
    staged = layout.staged_step(target)
    markers = [read_marker(staged, r) for r in range(cfg.strategy.world_size)] if staged.is_dir() else []
    if markers and all(m is not None for m in markers) and len({m.attempt for m in markers if m}) == 1:
        return f"step {target} is staged with every rank's marker (verify_manifest commits it)"
    return None


def _resume_step(layout: RunLayout) -> int:
    """Rank 0 only: the newest committed step, its files checked against the manifest."""
    latest = read_latest(layout)
    if latest is None:
        return 0
    verify_committed(layout.committed_step(latest.step))
    return latest.step


def _wrap(model: torch.nn.Module, cfg: PipelineConfig, device: torch.device) -> torch.nn.Module:
    model.to(device)
    if cfg.strategy.name == "fsdp2":
        for layer in model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def _state(model: Any, opt: Any, sched: Any, stream: SampleStream, step: int, rank: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {
        "model": msd,
        "optim": osd,
        "sched": sched.state_dict(),
        "train": {
            "step": torch.tensor(step),
            "data_epoch": torch.tensor(stream.pos.epoch),
            "data_offset": torch.tensor(stream.pos.offset),
        },
        "rng": {f"rank_{rank}": torch.get_rng_state()},
    }


def run(ctx: TaskContext) -> dict[str, object]:
    device = init_distributed(ctx.cfg.strategy)
    try:
        return _train(ctx, device)
    finally:
        dist.destroy_process_group()


def _train(ctx: TaskContext, device: torch.device) -> dict[str, object]:
    cfg, layout = ctx.cfg, ctx.layout
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != ctx.world_size:
        raise PipelineError(f"process group has {world} ranks but the train job was launched with {ctx.world_size}")
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(layout.assets)
    model = _wrap(build_model(cfg.model, tokenizer), cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = max(1, cfg.train.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    stream = SampleStream(layout.assets, cfg.data.seq_len, cfg.train.seed, cfg.train.micro_batch_size, rank, world)
    torch.manual_seed(cfg.train.seed + rank)
    ckpt_pg = dist.new_group(backend="gloo")  # checkpoint collectives never share the training group

    resume = int(broadcast_from_rank0(_resume_step(layout) if rank == 0 else None))
    if resume:
        state = _state(model, opt, sched, stream, 0, rank)
        load_into(state, layout.committed_step(resume), process_group=ckpt_pg)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        if int(state["train"]["step"]) != resume:
            raise VerificationError(f"checkpoint step_{resume} records step {int(state['train']['step'])}")
        stream.pos = DataPosition(int(state["train"]["data_epoch"]), int(state["train"]["data_offset"]))
        torch.set_rng_state(state["rng"][f"rank_{rank}"])
        log.info("rank %d resumed from step %d", rank, resume)

    losses: dict[int, float] = {}
    saved: list[int] = []
    failed: list[int] = []
    last = final_step(cfg)
    for step in range(resume + 1, last + 1):
        batch = stream.next_batch().to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = float(loss.detach())
        if rank == 0:
            log.info("step %d loss %.4f", step, losses[step])
        if is_save_step(cfg, step):
            ok = shard_save.save(ctx, step, _state(model, opt, sched, stream, step, rank), ckpt_pg)
            outcomes: list[object] = [None] * world
            dist.all_gather_object(outcomes, ok, group=ckpt_pg)  # so task 0's record tells of every rank's failure
            bad = [r for r, o in enumerate(outcomes) if not o]
            if bad and rank == 0:
                log.error("step %d was not saved by rank(s) %s; it will not be committed", step, bad)
            (failed if bad else saved).append(step)
    dist.barrier()
    return {"resumed_from": resume, "last_step": last, "saved": saved, "failed_saves": failed, "losses": losses}
