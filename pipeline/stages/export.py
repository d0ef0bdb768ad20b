"""export: consolidated step -> Hugging Face layout that ``from_pretrained`` loads offline.

Inputs: ``consolidated/step_N/`` (verified against its marker, which must name latest's manifest hash),
``assets/tokenizer``, the model config.
Outputs: ``export/step_N/``: ``model-0000i-of-0000n.safetensors`` shards no larger than
``export.max_shard_size`` (a tensor larger than that gets a shard of its own), ``model.safetensors.index.json``,
``config.json`` (the run's ``transformers`` architecture; a user module's factory), ``generation_config.json``,
tokenizer files, for LoRA runs with ``export.adapter`` also ``adapter/``, and ``provenance.json`` (done-marker:
source step, manifest hash, consolidated file hash, export settings, every file's size and hash). Tied weights are
written once and LoRA weights merged (:mod:`pipeline.workload.exported`).
Before anything is written, the consolidated tensors' names and shapes must be exactly those of the run's model
(built on the meta device; an imported checkpoint of another architecture fails here in one line, naming the
first difference). Not run with ``export=none``.
Owner: this single task. Memory: one tensor at a time (read through safetensors' mmap; a merged LoRA weight
also reads its two small factors). The writing is :mod:`pipeline.workload.export_writer`'s, imported by the job
alone (``torch``, ``transformers``): the driver reads this contract without them.
"""

from __future__ import annotations

import json

from pipeline.checkpoint.outputs import (
    CONSOLIDATED_MARKER,
    CONSOLIDATED_WEIGHTS,
    EXPORT_MARKER,
    source_step,
    verified_output,
)
from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError, VerificationError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import Resources, StageContract, TaskContext
from pipeline.storage.atomic import read_json
from pipeline.workload.size import DTYPE_BYTES, parameters

CONTRACT = StageContract(
    name="export",
    needs=("consolidate",),
    reads="consolidated/step_N/, assets/tokenizer",
    produces="export/step_N/ (HF layout: sharded safetensors + index, config.json, tokenizer, provenance.json)",
    marker="export/step_N/provenance.json",
    resources=Resources(cpus_per_task=1, mem_gb=4, timeout_min=60),
    writes_bytes=lambda cfg: parameters(cfg) * DTYPE_BYTES.get(cfg.export.dtype, 4),
)

MARKER = EXPORT_MARKER


def not_applicable(cfg: PipelineConfig) -> str | None:
    return "export=none: the consolidated checkpoint is the run's output" if cfg.export.format == "none" else None


def _source(cfg: PipelineConfig, layout: RunLayout) -> dict[str, object]:
    """What the export is made from (step, manifest hash, consolidated file hash, settings); reads, no hashing."""
    latest = source_step(layout, verify=False)
    marker_path = layout.consolidated_step(latest.step) / CONSOLIDATED_MARKER
    if not marker_path.exists():
        raise PipelineError(f"{marker_path} is missing: run stage=consolidate for step {latest.step} first")
    marker = read_json(marker_path)
    weights_hash = next((f["hash"] for f in marker["files"] if f["path"] == CONSOLIDATED_WEIGHTS), None)
    if weights_hash is None:
        raise VerificationError(f"{marker_path} lists no {CONSOLIDATED_WEIGHTS}")
    return {
        "step": latest.step,
        "manifest_hash": latest.manifest_hash,
        "consolidated_hash": weights_hash,
        "max_shard_size": cfg.export.max_shard_size,
        "dtype": cfg.export.dtype,
        **({"adapter": True} if cfg.export.adapter and cfg.model.lora.r else {}),
    }


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    latest = source_step(layout, verify=False)
    src_dir = layout.consolidated_step(latest.step)
    if not verified_output(src_dir, CONSOLIDATED_MARKER, {"step": latest.step, "manifest_hash": latest.manifest_hash}):
        raise PipelineError(
            f"{src_dir} is missing or does not verify against step {latest.step}: run stage=consolidate first"
        )


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    try:
        source = _source(cfg, layout)
    except (PipelineError, VerificationError, OSError, ValueError, KeyError, TypeError):
        return None
    out = layout.export_step(int(str(source["step"])))
    return f"{out} verifies against its source" if verified_output(out, MARKER, source) else None


def run(ctx: TaskContext) -> dict[str, object]:
    from pipeline.workload.export_writer import write_export  # noqa: PLC0415 - torch and transformers: the job only

    cfg, layout = ctx.cfg, ctx.layout
    source = _source(cfg, layout)
    step = int(str(source["step"]))
    files = write_export(cfg, layout, source, MARKER)
    return {"step": step, "out": str(layout.export_step(step)), "files": len(files), "source": json.dumps(source)}
