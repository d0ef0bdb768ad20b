"""consolidate: committed DCP step -> full-tensor safetensors, streamed tensor by tensor.

Inputs: the step named by ``checkpoints/latest``, its files verified against ``manifest.json``; DCP metadata
read with a restricted unpickler (no arbitrary code).
Outputs: ``consolidated/step_N/model.safetensors`` (model weights only, HF parameter names) and
``consolidated.json`` (done-marker: source step + manifest hash, file sizes and hashes).
Owner: this single task. Memory: one stored DCP chunk at a time (one tensor when it must be assembled), never the model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline.checkpoint.manifest import read_latest
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
from pipeline.formats.dcp_stream import TensorStreamer
from pipeline.formats.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from pipeline.orchestration.contract import Resources, StageContract, TaskContext
from pipeline.storage.layout import RunLayout, step_name

CONTRACT = StageContract(
    name="consolidate",
    needs=("verify_manifest",),
    reads="checkpoints/step_N/ (DCP) named by latest",
    produces="consolidated/step_N/model.safetensors",
    marker="consolidated/step_N/consolidated.json",
    resources=Resources(cpus_per_task=1, mem_gb=4, timeout_min=60),
)

MARKER = CONSOLIDATED_MARKER
WEIGHTS = CONSOLIDATED_WEIGHTS
MODEL_PREFIX = "model."


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


def consolidate_dcp(step_dir: Path, out: Path, on_tensor: Callable[[str], None] | None = None) -> int:
    """Stream every ``model.`` tensor of a DCP checkpoint into one safetensors file; return the tensor count."""
    streamer = TensorStreamer(step_dir, MODEL_PREFIX)
    if not streamer.entries:
        raise PipelineError(
            f"{step_dir} holds no tensors under '{MODEL_PREFIX}': not a training checkpoint of this pipeline"
        )
    specs = [TensorSpec(k[len(MODEL_PREFIX) :], m.properties.dtype, tuple(m.size)) for k, m in streamer.entries]
    writer = StreamingSafetensorsWriter(out, specs, metadata={"format": "pt"})
    for spec, (key, meta) in zip(specs, streamer.entries, strict=True):
        blocks = streamer.row_blocks(key, meta)
        if blocks is not None:
            writer.write_parts(spec.name, streamer.iter_row_blocks(meta, blocks))
        else:
            writer.write(spec.name, streamer.load(key, meta))
        if on_tensor is not None:
            on_tensor(spec.name)
    writer.close()
    return len(specs)


def run(ctx: TaskContext) -> dict[str, object]:
    layout = ctx.layout
    latest = source_step(layout, verify=False)  # check_inputs verified its files when this job started
    source = {"step": latest.step, "manifest_hash": latest.manifest_hash}
    final = layout.consolidated_step(latest.step)
    with staging_dir(layout.consolidated, step_name(latest.step)) as staging:
        count = consolidate_dcp(layout.committed_step(latest.step), staging / WEIGHTS)
        finish(staging, final, MARKER, source, [WEIGHTS], {"tensors": count})
    return {"step": latest.step, "tensors": count, "out": str(final)}
