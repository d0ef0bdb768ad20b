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

from collections.abc import Callable
from pathlib import Path

from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.checkpoint.outputs import (
    CONSOLIDATED_MARKER,
    CONSOLIDATED_WEIGHTS,
    finish,
    source_step,
    staging_dir,
    verified_output,
)
from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError, VerificationError
from pipeline.formats.dcp_stream import consolidate_dcp
from pipeline.formats.registry import get_format
from pipeline.orchestration.contract import Resources, StageContract, TaskContext
from pipeline.storage.layout import RunLayout, step_name

CONTRACT = StageContract(
    name="consolidate",
    needs=("verify_manifest",),
    reads="checkpoints/step_N/ (any committed format) named by latest",
    produces="consolidated/step_N/model.safetensors",
    marker="consolidated/step_N/consolidated.json",
    resources=Resources(cpus_per_task=1, mem_gb=4, timeout_min=60),
)

MARKER = CONSOLIDATED_MARKER
WEIGHTS = CONSOLIDATED_WEIGHTS
__all__ = ["CONTRACT", "consolidate_dcp", "consolidate_step", "run"]


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    source_step(layout, verify=True)


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    try:
        latest = read_latest(layout)
    except (VerificationError, OSError, ValueError):
        return None
    if latest is None:
        return None
    out = layout.consolidated_step(latest.step)
    if verified_output(out, MARKER, {"step": latest.step, "manifest_hash": latest.manifest_hash}):
        return f"{out} verifies against step {latest.step}'s manifest"
    return None


def consolidate_step(
    step_dir: Path, out: Path, on_tensor: Callable[[str], None] | None = None, allow_pickle: bool = False
) -> int:
    """Stream a committed step's model weights into ``out`` with the reader its manifest's format names
    (``allow_pickle``: ``import.allow_pickle`` of an import run)."""
    manifest = read_manifest(step_dir)
    fmt = get_format(manifest.format, step_dir / "manifest.json")
    if fmt.consolidate is None:
        raise PipelineError(f"{step_dir}: format {fmt.name} holds no model weights to consolidate")
    return fmt.consolidate(step_dir, out, on_tensor, allow_pickle)


def run(ctx: TaskContext) -> dict[str, object]:
    layout = ctx.layout
    latest = source_step(layout, verify=False)  # check_inputs verified its files when this job started
    source = {"step": latest.step, "manifest_hash": latest.manifest_hash}
    final = layout.consolidated_step(latest.step)
    with staging_dir(layout.consolidated, step_name(latest.step)) as staging:
        count = consolidate_step(
            layout.committed_step(latest.step), staging / WEIGHTS, allow_pickle=ctx.cfg.import_.allow_pickle
        )
        finish(staging, final, MARKER, source, [WEIGHTS], {"tensors": count})
    return {"step": latest.step, "tensors": count, "out": str(final)}
