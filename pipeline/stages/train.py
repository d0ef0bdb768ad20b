"""train: N tasks (``strategy.world_size``), DDP, FSDP2 or DeepSpeed ZeRO 1/2/3 over gloo (CPU) or NCCL (GPU).

Inputs: ``assets/`` (tokenizer, tokens) and, when resuming, the committed step named by ``checkpoints/latest``
— chosen by rank 0 only, verified against its manifest and broadcast to all ranks (ranks never each scan).
A step written at the same world size in DCP by DDP/FSDP2 is loaded by DCP (which also reshards it); any
other (another strategy, a DeepSpeed step at another world size) through its world-size-free form
(:mod:`pipeline.checkpoint.save.portable`), and the change is written to ``metrics.jsonl`` (``resume`` event).
Outputs: staged checkpoints every ``checkpoint.every`` steps and at the last step, through shard-save
(model, optimizer, LR scheduler, step, data position, RNG state of every rank); with
``checkpoint.async_save=true`` written in the background, each save settled (every rank agreeing) before the
next one starts and before train ends. With ``checkpoint.fast.every``, also a fast copy every K steps in a
node-local dir and on peer nodes (:mod:`pipeline.checkpoint.fast`), restored first when at least as new as
the durable tier's newest step.
Owner: each rank writes only its own staged files and marker; nothing is committed here.
Done-marker: the last step (``train.steps``, or ``train.stop_after_step``) is committed, or staged with every
rank's marker from the current attempt.
The job itself is :mod:`pipeline.stagekit.train_job`, imported by :func:`run` alone (``torch``, the model, DCP):
the driver reads this contract and its checks without them.
"""

from __future__ import annotations

import pipeline.stagekit.checkpoint_store as storage
from pipeline.checkpoint.manifest import MANIFEST, complete_markers, step_markers
from pipeline.config.schema import PipelineConfig, rank_batch_size
from pipeline.errors import PipelineError, VerificationError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import Resources, StageContract, TaskContext
from pipeline.stagekit.records import producer_attempt
from pipeline.storage.integrity import is_real_dir, lstat_kind, not_real_dirs
from pipeline.workload.size import checkpoint_bytes, final_step, save_count

CONTRACT = StageContract(
    name="train",
    needs=("prepare_dirs",),
    reads="assets/, checkpoints/latest (resume step, decided by rank 0 and broadcast)",
    produces="checkpoints/staging/step_N/ via shard-save",
    marker="final step committed, or staged with all rank markers",
    distributed=True,
    writes_bytes=lambda cfg: save_count(cfg) * checkpoint_bytes(cfg),
    reports_progress=True,
    sized_by=lambda cfg: Resources(
        cpus_per_task=1,
        mem_gb=4,
        timeout_min=cfg.train.time_limit_min,
        gpus_per_task=1 if cfg.strategy.backend == "nccl" else 0,
    ),
)


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    rank_batch_size(cfg.train, cfg.strategy.world_size)
    problems = not_real_dirs(layout.planned_dirs())
    if problems or lstat_kind(layout.assets / "assets.json") != "file" or not is_real_dir(layout.assets):
        why = "; ".join(problems) or f"{layout.assets} is not prepared"
        raise PipelineError(f"{why}: run stage=prepare_dirs for run {layout.run_id} first")


def _latest_step(cfg: PipelineConfig, layout: RunLayout) -> int:
    try:
        latest = storage.committed_latest(cfg, layout)
    except (PipelineError, OSError, ValueError):  # damaged, or a bucket that does not answer
        return -1
    return latest.step if latest else 0


def not_applicable(cfg: PipelineConfig) -> str | None:
    return "this run imports import.source instead of training" if cfg.import_.source else None


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    if cfg.import_.source:
        return "this run imports import.source instead of training"
    target = final_step(cfg)
    if _latest_step(cfg, layout) >= target:
        return f"step {target} is committed"
    if cfg.checkpoint.storage:
        return None  # a step staged in the bucket: train starts, and waits for the committer to commit it
    if is_real_dir(layout.committed_step(target)) and lstat_kind(layout.committed_step(target) / MANIFEST) == "file":
        return f"step {target} is published (verify_manifest moves latest)"
    attempt = producer_attempt(layout, CONTRACT.name)
    for where, said in (
        (layout.staged_step(target), "staged with every rank's marker (verify_manifest commits it)"),
        (layout.committed_step(target), "moved into place, its manifest not written yet (verify_manifest writes it)"),
    ):
        try:
            markers = step_markers(where, target, cfg.strategy.world_size) if is_real_dir(where) else []
        except VerificationError:
            continue  # the committer quarantines it; train saves the step again
        if markers and complete_markers(markers, attempt) is not None:
            return f"step {target} is {said}"
    return None


def run(ctx: TaskContext) -> dict[str, object]:
    from pipeline.stagekit.train_job import run_train  # noqa: PLC0415 - torch, the model and DCP: the job only

    return run_train(ctx)
