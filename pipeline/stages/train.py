"""train: N tasks (``strategy.world_size``), DDP, FSDP2 or DeepSpeed ZeRO 1/2/3 over gloo (CPU) or NCCL (GPU).

Inputs: ``assets/`` (tokenizer, tokens) and, when resuming, the committed step named by ``checkpoints/latest``
— chosen by rank 0 only, verified against its manifest and broadcast to all ranks (ranks never each scan).
A step written at the same world size in DCP by DDP/FSDP2 is loaded by DCP (which also reshards it); any
other (another strategy, a DeepSpeed step at another world size) through its world-size-free form
(:mod:`pipeline.checkpoint.portable`), and the change is written to ``metrics.jsonl`` (``resume`` event).
Outputs: staged checkpoints every ``checkpoint.every`` steps and at the last step, through shard-save
(model, optimizer, LR scheduler, step, data position, RNG state of every rank); with
``checkpoint.async_save=true`` written in the background, each save settled (every rank agreeing) before the
next one starts and before train ends.
Owner: each rank writes only its own staged files and marker; nothing is committed here.
Done-marker: the last step (``train.steps``, or ``train.stop_after_step``) is committed, or staged with every
rank's marker from the current attempt.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from pipeline.checkpoint.async_save import AsyncSaver, Settled, stuck_writers
from pipeline.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    complete_markers,
    read_latest,
    read_manifest,
    step_markers,
    verify_committed,
)
from pipeline.checkpoint.portable import TrainState, apply_native, open_portable
from pipeline.config.schema import PipelineConfig, rank_batch_size
from pipeline.errors import DeadlineError, PipelineError, VerificationError
from pipeline.formats.dcp import FORMAT as DCP_FORMAT
from pipeline.formats.dcp import load_into
from pipeline.orchestration.contract import Resources, StageContract, TaskContext
from pipeline.orchestration.preemption import no_requeue_reason, preemptible, preemption_requested
from pipeline.orchestration.records import producer_attempt, stage_alive
from pipeline.stages import shard_save
from pipeline.storage.integrity import is_real_dir, lstat_kind, not_real_dirs
from pipeline.storage.layout import RunLayout
from pipeline.storage.metrics import MetricsWriter
from pipeline.storage.waiting import wait_until
from pipeline.strategies import zero
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
    sized_by=lambda cfg: Resources(
        cpus_per_task=1,
        mem_gb=4,
        timeout_min=cfg.train.time_limit_min,
        gpus_per_task=1 if cfg.strategy.backend == "nccl" else 0,
    ),
)

log = logging.getLogger(__name__)
COMMITTER = "verify_manifest"
"""The stage beside train that commits its staged steps."""
_COMMITTER_START_S = 60.0


def final_step(cfg: PipelineConfig) -> int:
    stop = cfg.train.stop_after_step
    return cfg.train.steps if stop is None else min(stop, cfg.train.steps)


def is_save_step(cfg: PipelineConfig, step: int) -> bool:
    return step % cfg.checkpoint.every == 0 or step == cfg.train.steps or step == final_step(cfg)


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    rank_batch_size(cfg.train, cfg.strategy.world_size)
    problems = not_real_dirs(layout.planned_dirs())
    if problems or lstat_kind(layout.assets / "assets.json") != "file" or not is_real_dir(layout.assets):
        why = "; ".join(problems) or f"{layout.assets} is not prepared"
        raise PipelineError(f"{why}: run stage=prepare_dirs for run {layout.run_id} first")


def _latest_step(layout: RunLayout) -> int:
    try:
        latest = read_latest(layout)
    except (VerificationError, OSError, ValueError):
        return -1
    return latest.step if latest else 0


def not_applicable(cfg: PipelineConfig) -> str | None:
    return "this run imports import.source instead of training" if cfg.import_.source else None


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    if cfg.import_.source:
        return "this run imports import.source instead of training"
    target = final_step(cfg)
    if _latest_step(layout) >= target:
        return f"step {target} is committed"
    if is_real_dir(layout.committed_step(target)) and lstat_kind(layout.committed_step(target) / MANIFEST) == "file":
        return f"step {target} is published (verify_manifest moves latest)"
    staged = layout.staged_step(target)
    try:
        markers = step_markers(staged, target, cfg.strategy.world_size) if is_real_dir(staged) else []
    except VerificationError:
        return None  # the committer quarantines it; train saves the step again
    if markers and complete_markers(markers, producer_attempt(layout, CONTRACT.name)) is not None:
        return f"step {target} is staged with every rank's marker (verify_manifest commits it)"
    return None


def _staged_uncommitted(cfg: PipelineConfig, layout: RunLayout) -> list[int]:
    """Steps newer than ``latest`` staged with every rank's marker (one attempt) but not committed yet."""
    try:
        latest = read_latest(layout)
    except (VerificationError, OSError, ValueError):
        return []  # the committer repairs latest first; resuming then reports what it found
    done = latest.step if latest else 0
    pending = []
    for step in range(done + 1, final_step(cfg) + 1):
        staged = layout.staged_step(step)
        if not is_real_dir(staged):
            continue
        try:
            if complete_markers(step_markers(staged, step, cfg.strategy.world_size), None) is not None:
                pending.append(step)
        except VerificationError:
            continue
    return pending


def _await_staged(cfg: PipelineConfig, layout: RunLayout) -> None:
    """A step staged completely before a kill or a requeue is committed (by the committer beside this job)
    before train decides where to resume: never lost, never trained again, never rewritten under the committer."""
    if not _staged_uncommitted(cfg, layout):
        return
    start = time.monotonic()

    def committer_alive() -> bool:  # its job starts beside ours: give its record a moment to appear
        return stage_alive(layout, COMMITTER) or time.monotonic() - start < _COMMITTER_START_S

    wait_until(
        lambda: None if _staged_uncommitted(cfg, layout) else True,
        deadline_s=cfg.checkpoint.marker_deadline_s,
        what=lambda: (
            f"step(s) {_staged_uncommitted(cfg, layout)} in {layout.staging} have every rank's marker but are not "
            f"committed (is {COMMITTER} running beside train? run stage={COMMITTER} for run {layout.run_id})"
        ),
        alive=committer_alive,
        interval_s=0.5,
    )


def _resume_step(cfg: PipelineConfig, layout: RunLayout) -> int | str:
    """Rank 0 only: the newest committed step, its files checked against the manifest; or why it cannot be
    resumed (a message every rank raises, so no rank waits for a broadcast that never comes)."""
    try:
        _await_staged(cfg, layout)
    except DeadlineError as e:
        return f"cannot resume: {e}"
    try:
        latest = read_latest(layout)
        if latest is None:
            return 0
        verify_committed(layout.committed_step(latest.step), latest.step)
    except VerificationError as e:
        return f"cannot resume: {e}; run stage=verify_manifest (it quarantines the damage and moves latest back)"
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
        "rng": _rng_state(model, rank),
    }


def _train_state(sched: Any, stream: SampleStream, step: int, rank: int, device: torch.device) -> TrainState:
    """Everything but model and optimizer, for DeepSpeed steps (written as JSON beside DeepSpeed's files)."""
    rng = {f"rank_{rank}": torch.get_rng_state()}
    if device.type == "cuda":
        rng[f"rank_{rank}_cuda"] = torch.cuda.get_rng_state(device)
    return TrainState(step, stream.pos.epoch, stream.pos.offset, sched.state_dict(), rng)


def _save_step(
    ctx: TaskContext, trainer: _Trainer, sched: Any, stream: SampleStream, step: int, device: torch.device, pg: Any
) -> shard_save.SaveResult:
    if trainer.engine is not None:
        state = _train_state(sched, stream, step, ctx.rank, device)
        return shard_save.save_deepspeed(ctx, step, trainer.engine, state, trainer.format)
    return shard_save.save(ctx, step, _state(trainer.module, trainer.opt, sched, stream, step, ctx.rank), pg)


def _rng_state(model: Any, rank: int) -> dict[str, torch.Tensor]:
    """This rank's generators: CPU under ``rank_K`` (the key CPU checkpoints have), its GPU's under ``rank_K_cuda``."""
    rng = {f"rank_{rank}": torch.get_rng_state()}
    device = next(model.parameters()).device  # the rank's training device (FSDP2's DTensors report their local one)
    if device.type == "cuda":
        rng[f"rank_{rank}_cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _restore_rng(rng: dict[str, torch.Tensor], rank: int, device: torch.device) -> None:
    torch.set_rng_state(rng[f"rank_{rank}"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng[f"rank_{rank}_cuda"], device)


@dataclass
class _Trainer:
    """What the loop drives: ``net`` is called for the loss (DDP/FSDP2 module or DeepSpeed engine)."""

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


def _build(cfg: PipelineConfig, layout: RunLayout, device: torch.device, world: int) -> _Trainer:
    model = build_model(cfg.model, load_tokenizer(layout.assets))
    if cfg.strategy.name == "deepspeed":
        batch = rank_batch_size(cfg.train, world)
        engine, opt = zero.build_engine(model, cfg.strategy, batch, cfg.train.lr, cfg.train.weight_decay)
        return _Trainer(net=engine, module=engine.module, opt=opt, engine=engine)
    wrapped = _wrap(model, cfg, device)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    return _Trainer(net=wrapped, module=wrapped, opt=opt)


def _load_step(
    trainer: _Trainer,
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
        state = _state(trainer.module, trainer.opt, sched, stream, 0, rank)
        if manifest.world_size != world:
            del state["rng"]  # the generators of ranks that no longer exist (or not yet) are not carried
        load_into(state, step_dir, process_group=pg)
        set_state_dict(trainer.module, trainer.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return TrainState(
            step=int(state["train"]["step"]),
            data_epoch=int(state["train"]["data_epoch"]),
            data_offset=int(state["train"]["data_offset"]),
            sched=state["sched"],
            rng=state.get("rng", {}),
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


def _resume(
    ctx: TaskContext,
    trainer: _Trainer,
    sched: Any,
    stream: SampleStream,
    device: torch.device,
    pg: Any,
    metrics: MetricsWriter | None,
) -> int:
    """Load the committed step rank 0 chose (0: start fresh); every rank restores its own RNG and data position."""
    cfg, layout, rank = ctx.cfg, ctx.layout, dist.get_rank()
    decided = broadcast_from_rank0(_resume_step(cfg, layout) if rank == 0 else None)
    if isinstance(decided, str):
        raise VerificationError(decided)
    resume = int(decided)
    if not resume:
        return 0
    step_dir = layout.committed_step(resume)
    manifest = read_manifest(step_dir)  # rank 0 verified the step's files against it
    world = dist.get_world_size()
    train = _load_step(trainer, sched, stream, step_dir, manifest, rank, world, pg)
    sched.load_state_dict(train.sched)
    for group, lr in zip(trainer.opt.param_groups, sched.get_last_lr(), strict=True):
        group["lr"] = lr  # the rate of the next step (a world-size-free load carries no param groups)
    if train.step != resume:
        raise VerificationError(f"checkpoint step_{resume} records step {train.step}")
    stream.pos = DataPosition(train.data_epoch, train.data_offset)
    if f"rank_{rank}" in train.rng and (device.type != "cuda" or f"rank_{rank}_cuda" in train.rng):
        _restore_rng(train.rng, rank, device)
    else:  # a rank the step did not have: seeded from the run's seed, its rank and the step
        torch.manual_seed(cfg.train.seed + rank + 1_000_003 * resume)
    if (manifest.format, manifest.world_size) != (trainer.format, world):
        _event(
            metrics,
            ctx,
            "resume",
            step=resume,
            from_format=manifest.format,
            from_world_size=manifest.world_size,
            to_format=trainer.format,
            to_world_size=world,
            strategy=cfg.strategy.name,
        )
        if rank == 0:
            log.info(
                "resumed step %d written as %s by %d ranks, now %s on %d ranks",
                resume,
                manifest.format,
                manifest.world_size,
                trainer.format,
                world,
            )
    log.info("rank %d resumed from step %d", rank, resume)
    return resume


def _event(metrics: MetricsWriter | None, ctx: TaskContext, event: str, **fields: object) -> None:
    """One line of ``metrics.jsonl``; ``metrics`` is None on every rank but 0, the file's one writer."""
    if metrics is not None:
        metrics.append({"event": event, "attempt": ctx.attempt, **fields, "time": time.time()})


def _gather_save(
    ctx: TaskContext,
    step: int,
    result: shard_save.SaveResult,
    ckpt_pg: Any,
    metrics: MetricsWriter | None,
    errors: dict[int, str],
    blocked_s: float,
    **extra: object,
) -> str:
    """Every rank's save of ``step`` (one all_gather), so that task 0's record tells of every rank's failure;
    rank 0 logs the ranks that failed and writes the checkpoint event (``blocked_s``: training blocked by it,
    the slowest rank's). Returns "" when every rank saved, else what failed (the same text on every rank)."""
    outcomes: list[Any] = [None] * dist.get_world_size(group=ckpt_pg)
    dist.all_gather_object(outcomes, (result, blocked_s), group=ckpt_pg)
    bad = [r for r, (o, _) in enumerate(outcomes) if not o.ok]
    why = "; ".join(f"rank {r}: {outcomes[r][0].error}" for r in bad)
    if bad and dist.get_rank() == 0:
        log.error("step %d was not saved by rank(s) %s; it will not be committed", step, bad)
        errors[step] = why
    staged_bytes = sum(o.bytes for o, _ in outcomes)
    seconds = max(o.seconds for o, _ in outcomes)  # the ranks save in parallel: the slowest sets the time
    gbps = staged_bytes / seconds / 1e9 if seconds > 0 else 0.0
    blocked = max(b for _, b in outcomes)
    _event(
        metrics,
        ctx,
        "checkpoint",
        step=step,
        bytes=staged_bytes,
        seconds=seconds,
        gbps=gbps,
        ok=not bad,
        blocked_s=blocked,
        **extra,
    )
    return why


def _settle(
    ctx: TaskContext,
    saver: AsyncSaver,
    ckpt_pg: Any,
    metrics: MetricsWriter | None,
    errors: dict[int, str],
    saved: list[int],
    failed: list[int],
) -> None:
    """Wait for the pending async save (deadline-bounded, every rank leaving the wait together), then record
    it as a sync save is recorded; after a failure every rank drops its writer, buffer and group alike and
    either trains on without that step or stops (``checkpoint.fail_on_save_error``)."""
    done: Settled | None = saver.wait()
    if done is None:
        return
    result = shard_save.SaveResult(ok=done.ok, bytes=done.bytes, seconds=done.persist_s, error=done.error)
    why = _gather_save(
        ctx, done.step, result, ckpt_pg, metrics, errors, done.blocked_s, persist_s=done.persist_s, mode="async"
    )
    (failed if why else saved).append(done.step)
    if not why:
        return
    saver.discard()
    if ctx.cfg.checkpoint.fail_on_save_error:
        raise PipelineError(
            f"async save of step {done.step} failed ({why}); training stopped (checkpoint.fail_on_save_error=true): "
            f"rerun to resume from the last committed step, or raise checkpoint.async_deadline_s if it only stalled"
        )
    if ctx.rank == 0:
        log.error("step %d is not saved (%s); training continues (checkpoint.fail_on_save_error=false)", done.step, why)


def run(ctx: TaskContext) -> dict[str, object]:
    device = init_distributed(ctx.cfg.strategy)
    try:
        return _train(ctx, device)
    finally:
        stuck = stuck_writers()
        if stuck:  # destroying a group under a stuck writer could hang; its daemon thread ends with the process
            log.warning("process groups left to the process exit: %s", "; ".join(stuck))
        else:
            dist.destroy_process_group()


def _train(ctx: TaskContext, device: torch.device) -> dict[str, object]:
    cfg, layout = ctx.cfg, ctx.layout
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != ctx.world_size:
        raise PipelineError(f"process group has {world} ranks but the train job was launched with {ctx.world_size}")
    torch.set_num_threads(1)
    trainer = _build(cfg, layout, device, world)
    warmup = max(1, cfg.train.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(trainer.opt, lambda s: min(1.0, (s + 1) / warmup))
    batch_size = rank_batch_size(cfg.train, world)
    stream = SampleStream(layout.assets, cfg.data.seq_len, cfg.train.seed, batch_size, rank, world)
    torch.manual_seed(cfg.train.seed + rank)
    # Checkpoint collectives never share the training group, and wait no longer than it does.
    ckpt_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.strategy.pg_timeout_s))
    metrics = MetricsWriter(layout.metrics) if rank == 0 else None

    resume = _resume(ctx, trainer, sched, stream, device, ckpt_pg, metrics)

    losses: dict[int, float] = {}
    saved: list[int] = []
    failed: list[int] = []
    save_errors: dict[int, str] = {}
    last = final_step(cfg)
    _event(metrics, ctx, "start", resume_from=resume, total=last, world_size=world, format=trainer.format)
    saver = None
    if cfg.checkpoint.async_save and trainer.engine is None:
        saver = AsyncSaver(
            rank, ckpt_pg, cfg.checkpoint.async_deadline_s, cfg.checkpoint.writer_threads_for(ctx.world_size)
        )
    try:
        last = _loop(
            ctx, trainer, sched, stream, device, ckpt_pg, metrics, saver, resume, losses, saved, failed, save_errors
        )
        if saver is not None:  # the last save (the final step's, or the one before a requeue) is settled too
            _settle(ctx, saver, ckpt_pg, metrics, save_errors, saved, failed)
    except BaseException as e:
        if saver is not None:
            saver.abandon(f"train failed: {type(e).__name__}")
        raise
    probe = _probe_logits(trainer, stream, device) if last == final_step(cfg) else None
    dist.barrier()
    _event(metrics, ctx, "end", last_step=last)
    summary: dict[str, object] = {
        "resumed_from": resume,
        "last_step": last,
        "saved": saved,
        "failed_saves": failed,
        "save_errors": save_errors,
        "losses": losses,
    }
    if probe is not None and rank == 0:
        summary["probe"] = probe
    if last < final_step(cfg):  # stopped on SLURM's USR2: requeue, or stop for good past max_num_timeout
        why = no_requeue_reason(cfg)
        if why is not None:
            raise PipelineError(f"{why}; step {last} is saved: continue with python -m pipeline run.id={layout.run_id}")
        summary["requeue"] = True
    return summary


def _loop(
    ctx: TaskContext,
    trainer: _Trainer,
    sched: Any,
    stream: SampleStream,
    device: torch.device,
    ckpt_pg: Any,
    metrics: MetricsWriter | None,
    saver: AsyncSaver | None,
    resume: int,
    losses: dict[int, float],
    saved: list[int],
    failed: list[int],
    save_errors: dict[int, str],
) -> int:
    """Train from ``resume`` to the last step, saving at checkpoint steps; returns the last step trained
    (earlier than the final step when a preemption stopped it)."""
    cfg, rank, world = ctx.cfg, dist.get_rank(), dist.get_world_size()
    last = final_step(cfg)
    for step in range(resume + 1, last + 1):
        t0 = time.monotonic()
        batch = stream.next_batch().to(device)
        loss = trainer.net(input_ids=batch, labels=batch).loss
        trainer.step(loss)
        lr = sched.get_last_lr()[0]  # the rate this step used
        sched.step()
        trainer.zero_grad()
        losses[step] = _global_mean(loss.detach(), world)
        if rank == 0:
            log.info("step %d loss %.4f", step, losses[step])
        tokens = batch.numel() * world  # every rank trains on an equal batch
        _event(metrics, ctx, "step", step=step, loss=losses[step], lr=lr, tokens=tokens, step_s=time.monotonic() - t0)
        stop = preemptible() and _any_rank(preemption_requested(), ckpt_pg)
        if (is_save_step(cfg, step) or stop) and saver is not None:
            t_save = time.monotonic()  # blocked: settling the previous save, building the state, staging it
            _settle(ctx, saver, ckpt_pg, metrics, save_errors, saved, failed)
            state = _state(trainer.module, trainer.opt, sched, stream, step, rank)
            shard_save.save_async(ctx, saver, step, state, waited_s=time.monotonic() - t_save)
        elif is_save_step(cfg, step) or stop:
            t_save = time.monotonic()
            result = _save_step(ctx, trainer, sched, stream, step, device, ckpt_pg)
            blocked = time.monotonic() - t_save
            why = _gather_save(ctx, step, result, ckpt_pg, metrics, save_errors, blocked, mode="sync")
            (failed if why else saved).append(step)
        if stop:
            return step
    return last


PROBE_TOKENS = 16


def _probe_logits(trainer: _Trainer, stream: SampleStream, device: torch.device) -> dict[str, object]:
    """The trained model's logits on a fixed probe (the corpus' first sample), as the training engine computes
    them (every rank takes part: ZeRO-3 and FSDP2 gather their shards): what an export must reproduce."""
    ids = stream.samples[0, :PROBE_TOKENS].unsqueeze(0).to(device)
    with torch.no_grad():
        logits = trainer.net(input_ids=ids).logits.float().cpu()
    return {"input_ids": ids.cpu().flatten().tolist(), "shape": list(logits.shape), "logits": logits.flatten().tolist()}


def _global_mean(loss: torch.Tensor, world: int) -> float:
    """The step's loss over the global batch (every rank's batch is equally large): the same number at any world
    size for the same global batch, so loss curves compare across world sizes and strategies."""
    total = loss.float().reshape(1).clone()
    dist.all_reduce(total)
    return float(total.item()) / world


def _any_rank(flag: bool, group: Any) -> bool:
    """True on every rank if ``flag`` is true on any (all ranks stop at the same step)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
