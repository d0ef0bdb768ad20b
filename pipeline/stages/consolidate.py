"""consolidate: committed step -> full-tensor safetensors, streamed tensor by tensor.

Inputs: the step named by ``checkpoints/latest``, its files verified against ``manifest.json``, read by the
reader its manifest's format names (:mod:`pipeline.formats.registry`: DCP metadata with a restricted
unpickler; DeepSpeed ZeRO files with a restricted, lazy torch.save reader; no arbitrary code).
Outputs: ``consolidated/step_N/model.safetensors`` (model weights only, HF parameter names) and
``consolidated.json`` (done-marker: source step + manifest hash, file sizes and hashes).
Owner: this single task. Memory: one stored chunk or partition slice at a time (one tensor when it must be
assembled), never the model. DeepSpeed's fp32 master weights are what a ZeRO step consolidates to (equal, tensor
for tensor, to DeepSpeed's ``zero_to_fp32``).
"""

from __future__ import annotations

import pipeline.stagekit.checkpoint_store as storage
from pipeline.checkpoint.outputs import (
    CONSOLIDATED_MARKER,
    CONSOLIDATED_WEIGHTS,
    consolidate_latest,
    consolidate_step,
    source_step,
    verified_output,
)
from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import Resources, StageContract, TaskContext
from pipeline.stagekit.records import resume_command
from pipeline.storage.integrity import lstat_kind
from pipeline.workload.size import parameters

CONTRACT = StageContract(
    name="consolidate",
    needs=("verify_manifest",),
    reads="checkpoints/step_N/ (any committed format) named by latest",
    produces="consolidated/step_N/model.safetensors",
    marker="consolidated/step_N/consolidated.json",
    resources=Resources(cpus_per_task=1, mem_gb=4, timeout_min=60),
    writes_bytes=lambda cfg: parameters(cfg) * 4,
)

MARKER = CONSOLIDATED_MARKER
WEIGHTS = CONSOLIDATED_WEIGHTS
__all__ = ["CONTRACT", "consolidate_step", "run"]


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    storage.pull(cfg, layout)  # with a bucket: the verified copy of its latest step, read by what follows
    if lstat_kind(layout.latest) is None:  # e.g. train ended well but none of its saves was committed
        raise PipelineError(
            f"nothing to consolidate: no step of run {layout.run_id} is committed ({layout.latest} does not exist); "
            f"see why with python -m pipeline.status {layout.run_dir}, then resume: {resume_command(layout)}"
        )
    source_step(layout, verify=True)


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    try:
        latest = storage.committed_latest(cfg, layout)
    except (PipelineError, OSError, ValueError):
        return None
    if latest is None:
        return None
    out = layout.consolidated_step(latest.step)
    if verified_output(out, MARKER, {"step": latest.step, "manifest_hash": latest.manifest_hash}):
        return f"{out} verifies against step {latest.step}'s manifest"
    return None


def run(ctx: TaskContext) -> dict[str, object]:
    # check_inputs verified the step's files when this job started; is_done said the output needs building
    return consolidate_latest(ctx.layout, allow_pickle=ctx.cfg.import_.allow_pickle, verify=False, force=True)
