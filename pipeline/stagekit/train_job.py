"""The train stage's job on one rank: build the trainer, resume (fast tier, else the committed step rank 0
chose), the loop with its saves through the library's checkpoint session, and the summary the stage records.

Imported by :mod:`pipeline.stages.train`'s ``run`` only: it loads ``torch``, ``transformers`` and DCP, which the
driver, ``--help`` and the plan never need.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import pipeline.stagekit.checkpoint_store as storage
from pipeline.checkpoint import options
from pipeline.checkpoint import resume as resume_rule
from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.save import pieces
from pipeline.checkpoint.save.async_save import stuck_writers
from pipeline.checkpoint.save.portable import TrainState
from pipeline.checkpoint.save.session import Agreed, CheckpointSession
from pipeline.checkpoint.save.state import MODEL
from pipeline.config.schema import PipelineConfig, rank_batch_size
from pipeline.errors import PipelineError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit import fast_tier, saving
from pipeline.stagekit.contract import TaskContext
from pipeline.stagekit.preemption import no_requeue_reason, preemptible, preemption_requested
from pipeline.stagekit.records import stage_alive
from pipeline.storage.metrics import MetricsWriter
from pipeline.strategies import trainer as strategy
from pipeline.strategies.process_group import init_distributed
from pipeline.strategies.user_loop import LoopContext, eval_loss, run_user_loop
from pipeline.workload.corpus import check_unchanged
from pipeline.workload.data import DataPosition, SampleStream
from pipeline.workload.size import final_step, is_save_step
from pipeline.workload.tensorboard import TensorBoardSink

log = logging.getLogger("pipeline.stages.train")
COMMITTER = "verify_manifest"
"""The stage beside train that commits its staged steps."""
_COMMITTER_START_S = 60.0
PROBE_ENV = "PIPELINE_PROBE_FILE"
"""Tests set it to a path: rank 0 writes the trained model's logits on a fixed probe there (what an export must
reproduce). Never part of the stage record."""
NAME = "train"


def resume_step(cfg: PipelineConfig, layout: RunLayout) -> int | str:
    """Rank 0 only: the library's resume rule, with the committer job beside train as the committer."""
    start = time.monotonic()

    def committer_alive() -> bool:  # its job starts beside ours: give its record a moment to appear
        alive = stage_alive(layout, COMMITTER) or time.monotonic() - start < _COMMITTER_START_S
        if not alive:
            log.error("NO COMMITTER IS RUNNING beside train (%s has no live record): nothing gets committed", COMMITTER)
        return alive

    return resume_rule.decide(
        layout,
        cfg.strategy.world_size,
        deadline_s=cfg.checkpoint.marker_deadline_s,
        committer_alive=committer_alive,
        upto=final_step(cfg),
        committer_hint=f" (is {COMMITTER} running beside train? run stage={COMMITTER} for run {layout.run_id})",
        repair_hint="; run stage=verify_manifest (it quarantines the damage and moves latest back)",
        remote=storage.remote(cfg, layout),
    )


class _Run:
    """One attempt of train on this rank: the trainer, its schedule and data, and its checkpoint session (the
    library's save path), with the app's events around it."""

    def __init__(self, ctx: TaskContext, device: torch.device) -> None:
        cfg = ctx.cfg
        self.ctx, self.cfg, self.layout, self.device = ctx, cfg, ctx.layout, device
        self.started = time.monotonic()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.rank == 0:
            check_unchanged(ctx.layout.assets)  # token files read in place must be the ones the run was made with
        self.trainer = strategy.build(cfg, ctx.layout, device, self.world)
        self.sched = strategy.make_schedule(self.trainer.opt, cfg.train)
        self.groups = pieces.shared_groups(self.trainer.module, MODEL) if self.trainer.engine is None else {}
        """The FQNs saved as shared pieces (frozen parameters, buffers): written again only when they change."""
        batch_size = rank_batch_size(cfg.train, self.world)
        data = cfg.data
        self.stream = SampleStream(
            ctx.layout.assets, data.seq_len, cfg.train.seed, batch_size, self.rank, self.world, data.eval_samples
        )
        torch.manual_seed(cfg.train.seed + self.rank)
        # Checkpoint collectives never share the training group, and wait no longer than it does.
        self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.strategy.pg_timeout_s))
        self.metrics = MetricsWriter(ctx.layout.metrics) if self.rank == 0 else None
        self.tensorboard = TensorBoardSink(ctx.layout.run_dir / "tensorboard") if self.rank == 0 else None
        self.async_save = cfg.checkpoint.async_save and self.trainer.engine is None
        self.session = CheckpointSession(
            saving.target(ctx),
            self.pg,
            async_deadline_s=cfg.checkpoint.async_deadline_s,
            on_agreed=self.recorded,
            stop_hint="; training stopped (checkpoint.fail_on_save_error=true): rerun to resume from the last "
            "committed step, or raise checkpoint.async_deadline_s if it only stalled",
            continue_hint=" (checkpoint.fail_on_save_error=false)",
        )
        self.fast = fast_tier.open_tier(ctx, self.pg, deepspeed=self.trainer.engine is not None)
        self._losses = (0.0, 0)
        """The sum and count of the steps' losses (each the mean over ranks) since the last save."""
        self._eval: tuple[int, float] | None = None

    def event(self, event: str, **fields: object) -> None:
        """One line of ``metrics.jsonl``; only rank 0 writes the file."""
        if self.metrics is not None:
            self.metrics.append({"event": event, "attempt": self.ctx.attempt, **fields, "time": time.time()})
        if self.tensorboard is not None:
            self.tensorboard.add({"event": event, **fields})

    # -- resume ------------------------------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the committed step rank 0 chose (0: start fresh); every rank restores its RNG and data position."""
        cfg, rank = self.cfg, self.rank
        loaded: list[tuple[TrainState, Manifest | None]] = []

        def load(step_dir: Path, manifest: Manifest) -> int:
            train = strategy.load_step(
                self.trainer, self.sched, self.stream, step_dir, manifest, rank, self.world, self.pg
            )
            loaded.append((train, manifest))
            return train.step

        def loaded_fast(train: TrainState) -> int:
            loaded[:] = [(train, None)]
            return train.step

        landing = strategy.fast_landing(self.trainer, self.sched, self.stream, rank, loaded_fast)
        fast = fast_tier.resume_with(self.ctx, self.fast, landing)
        first, floor = (fast.first, fast.floor) if fast is not None else (None, None)
        resume = self.session.load_latest(lambda: resume_step(cfg, self.layout), load, first=first, floor=floor)
        if fast is not None:
            fast.settled(resume)
        if fast is not None and rank == 0:
            fast.record(resume)
        if not resume:
            return 0
        train, manifest = loaded[-1]
        self.sched.load_state_dict(train.sched)
        for group, lr in zip(self.trainer.opt.param_groups, self.sched.get_last_lr(), strict=True):
            group["lr"] = lr  # the rate of the next step (a world-size-free load carries no param groups)
        self.stream.pos = DataPosition(train.data_epoch, train.data_offset)
        if not strategy.restore_rng(train.rng, rank, self.device):
            torch.manual_seed(cfg.train.seed + rank + 1_000_003 * resume)  # a rank the step did not have
        fmt = self.trainer.format
        if manifest is not None and (manifest.format, manifest.world_size) != (fmt, self.world):
            self.event(
                "resume",
                step=resume,
                from_format=manifest.format,
                from_world_size=manifest.world_size,
                to_format=fmt,
                to_world_size=self.world,
                strategy=cfg.strategy.name,
            )
            if rank == 0:
                log.info(
                    "resumed step %d written as %s by %d rank(s), now %s on %d rank(s)",
                    resume,
                    manifest.format,
                    manifest.world_size,
                    fmt,
                    self.world,
                )
        return resume

    # -- saves -------------------------------------------------------------------------------------------------

    def step_metrics(self, step: int) -> dict[str, float | None]:
        """What the step records in its manifest (``checkpoint.keep_best`` ranks by it, ``status`` shows it):
        ``loss``, the mean of the losses of the steps this attempt trained since the last save (or since it
        resumed), and ``eval_loss`` when eval ran at ``step``."""
        total, count = self._losses
        out = options.check_metrics({"loss": total / count} if count else {})
        if self._eval is not None and self._eval[0] == step:
            out |= options.check_metrics({"eval_loss": self._eval[1]})
        self._losses = (0.0, 0)
        return out

    def save(self, step: int) -> None:
        """Save ``step`` through the session: async (DDP/FSDP2 with ``checkpoint.async_save``) or blocking."""
        started = time.monotonic()  # blocked: settling the previous save, building the state, writing or staging
        trainer, metrics = self.trainer, self.step_metrics(step)
        if trainer.engine is not None:
            train = strategy.train_state(self.sched, self.stream, step, self.rank, self.device)
            write = saving.deepspeed_files(self.rank, trainer.engine, train)
            self.session.save_files(step, trainer.format, write, started, metrics)
            return
        state = strategy.dcp_state(trainer, self.sched, self.stream, step, self.rank)
        if self.async_save:
            self.session.save_async(step, state, self.groups, started, metrics)
        else:
            self.session.save(step, state, self.groups, started, metrics)

    def recorded(self, agreed: Agreed) -> None:
        """After every rank agreed on a save (the session's hook): the checkpoint event (``blocked_s``: training
        blocked by it, the slowest rank's) and, on rank 0, the warning when no committer runs beside train."""
        started_long_ago = time.monotonic() - self.started > _COMMITTER_START_S  # its job starts beside ours
        if self.rank == 0 and agreed.ok and started_long_ago and not stage_alive(self.layout, COMMITTER):
            self.event("no_committer", step=agreed.step)  # the launching process shows it on the console
            log.error(
                "NO COMMITTER IS RUNNING beside train: step %d is staged but nothing commits it and latest stays "
                "behind (the launcher starts %s again; else run stage=%s for run %s)",
                agreed.step,
                COMMITTER,
                COMMITTER,
                self.layout.run_id,
            )
        extra = {} if agreed.persist_s is None else {"persist_s": agreed.persist_s}
        self.event(
            "checkpoint",
            step=agreed.step,
            bytes=agreed.bytes,
            shared_bytes=agreed.shared,
            seconds=agreed.seconds,
            gbps=agreed.gbps,
            ok=agreed.ok,
            blocked_s=agreed.blocked_s,
            **extra,
            mode=agreed.mode,
        )

    # -- the loop ----------------------------------------------------------------------------------------------

    def evaluate(self, step: int) -> None:
        """The mean loss over the held-out samples (each rank takes its share; one all_reduce)."""
        batches = self.stream.eval_batches(rank_batch_size(self.cfg.train, self.world))
        loss, samples = eval_loss(self.trainer, batches, self.device, self.pg)
        if self.rank == 0:
            log.info("step %d eval loss %.4f", step, loss)
        self.event("eval", step=step, loss=loss, samples=samples)
        self._eval = (step, loss)

    def loop(self, resume: int) -> int:
        """Train from ``resume`` to the last step, saving at checkpoint steps; returns the last step trained
        (earlier than the final step when a preemption stopped it)."""
        last = final_step(self.cfg)
        self._step_start = time.monotonic()
        if self.cfg.train.loop._target_:
            return run_user_loop(self.loop_context(resume, last))
        for step in range(resume + 1, last + 1):
            batch = self.stream.next_batch(step).to(self.device)
            loss = self.trainer.train_step(batch)
            if self.step_done(step, loss, batch.numel()):
                return step
        return last

    def loop_context(self, resume: int, last: int) -> LoopContext:
        return LoopContext(
            self.cfg,
            self.trainer,
            self.stream,
            self.device,
            self.rank,
            self.world,
            resume,
            last,
            self.step_done,
            self.sched,
        )

    def step_done(self, step: int, loss: torch.Tensor, tokens: int) -> bool:
        """After a step: the schedule, the step's metrics, eval, the checkpoint and the preemption check (the
        built-in loop's and a user loop's alike); True when training stops here."""
        cfg = self.cfg
        lr = self.sched.get_last_lr()[0]  # the rate this step used
        self.sched.step()
        mean = strategy.global_mean(loss.detach().float(), self.world)
        self._losses = (self._losses[0] + mean, self._losses[1] + 1)
        if self.rank == 0:
            log.info("step %d loss %.4f", step, mean)
        tokens *= self.world  # every rank trains on an equal batch
        now = time.monotonic()
        step_s, self._step_start = now - self._step_start, now
        self.event("step", step=step, loss=mean, lr=lr, tokens=tokens, step_s=step_s, tokens_per_s=tokens / step_s)
        every = cfg.train.eval_every
        if every is not None and cfg.data.eval_samples and (step % every == 0 or step == final_step(cfg)):
            self.evaluate(step)
        stop = preemptible() and self.session.any_rank(preemption_requested())
        if is_save_step(cfg, step) or stop:
            if self.fast is not None:  # the fast step before is whole before the durable save begins: a rank
                self.fast.wait()  # that dies in the durable save never costs it (bounded by the deadline)
            self.save(step)
        if self.fast is not None and self.fast.due(step):  # node-local and on a peer node, in the background
            state = strategy.dcp_state(self.trainer, self.sched, self.stream, step, self.rank)
            self.fast.save(step, state, self.session.any_rank)
        self._step_start = time.monotonic()  # a save's time is not the next step's
        return stop


def _train(ctx: TaskContext, device: torch.device) -> dict[str, object]:
    cfg, layout = ctx.cfg, ctx.layout
    if dist.get_world_size() != ctx.world_size:
        raise PipelineError(
            f"process group has {dist.get_world_size()} rank(s) but the train job was launched with {ctx.world_size}"
        )
    torch.set_num_threads(1)
    r = _Run(ctx, device)
    resume = r.resume()
    r.event("start", resume_from=resume, total=final_step(cfg), world_size=r.world, format=r.trainer.format)
    try:
        last = r.loop(resume)
        r.session.wait()  # the last save (the final step's, or the one before a requeue) is settled too
        if r.fast is not None:
            r.fast.close()
    except BaseException as e:
        r.session.abandon(f"train failed: {type(e).__name__}")
        if r.fast is not None:
            r.fast.close(settle=False)
        raise
    if last == final_step(cfg) and os.environ.get(PROBE_ENV):
        strategy.write_probe(r.trainer, r.stream, device, os.environ[PROBE_ENV], r.rank)
    dist.barrier()
    r.event("end", last_step=last)
    if r.tensorboard is not None:
        r.tensorboard.close()
    summary: dict[str, object] = {
        "resumed_from": resume,
        "last_step": last,
        "saved": r.session.saved,
        "failed_saves": r.session.failed,
        "save_errors": r.session.errors if r.rank == 0 else {},
    }
    if last < final_step(cfg):  # stopped on SLURM's USR2: requeue, or stop for good past max_num_timeout
        why = no_requeue_reason(cfg)
        if why is not None:
            raise PipelineError(f"{why}; step {last} is saved: continue with python -m pipeline run.id={layout.run_id}")
        summary["requeue"] = True
    return summary


def run_train(ctx: TaskContext) -> dict[str, object]:
    device = init_distributed(ctx.cfg.strategy)
    try:
        return _train(ctx, device)
    finally:
        stuck = stuck_writers()
        if stuck:  # destroying a group under a stuck writer could hang; its daemon thread ends with the process
            log.warning("process groups left to the process exit: %s", "; ".join(stuck))
        else:
            dist.destroy_process_group()
