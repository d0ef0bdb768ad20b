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
also reads its two small factors).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import GenerationConfig, PreTrainedTokenizerBase

from pipeline.checkpoint.outputs import (
    CONSOLIDATED_MARKER,
    CONSOLIDATED_WEIGHTS,
    EXPORT_MARKER,
    finish,
    source_step,
    staging_dir,
    verified_output,
)
from pipeline.config.schema import ExportConfig, ModelConfig, PipelineConfig, parse_size
from pipeline.errors import CheckpointFormatError, PipelineError, VerificationError
from pipeline.formats.safetensors_shards import write_sharded
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import Resources, StageContract, TaskContext
from pipeline.storage.atomic import read_json, write_json_atomic
from pipeline.storage.layout import step_name
from pipeline.workload.corpus import load_tokenizer
from pipeline.workload.exported import ExportTensor, adapter_tensors, check_fits, export_tensors, model_hint
from pipeline.workload.model import base_model, build_model, factory_config, is_transformers
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
ADAPTER_DIR = "adapter"


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


def _unreadable(src: Path, e: SafetensorError) -> CheckpointFormatError:
    """A consolidated file whose header or data is malformed."""
    return CheckpointFormatError(
        f"{src} is not a readable safetensors file ({(str(e) or type(e).__name__).splitlines()[0][:200]})"
    )


def _stored_shapes(src: Path) -> dict[str, tuple[int, ...]]:
    try:
        with safe_open(str(src), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in sorted(f.keys())}
    except SafetensorError as e:
        raise _unreadable(src, e) from None


def check_fits_model(src: Path, model: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    """The run's model on the meta device, once the stored weights are known to fit it (else a one-line error)."""
    reference = build_model(model, tokenizer, meta=True)
    check_fits(_stored_shapes(src), reference, str(src), model_hint(model, tokenizer))
    return reference


def _write(src: Path, staging: Path, export: ExportConfig, tensors: list[ExportTensor], **kw: Any) -> list[str]:
    try:
        plan = [(t.name, t.shape, t.read) for t in tensors]
        return write_sharded(src, staging, getattr(torch, export.dtype), parse_size(export.max_shard_size), plan, **kw)
    except SafetensorError as e:
        raise _unreadable(src, e) from None


def _write_config(staging: Path, reference: torch.nn.Module, cfg: PipelineConfig) -> None:
    """``config.json`` (+ ``generation_config.json``) of a ``transformers`` model; a user module's factory."""
    if not is_transformers(reference):
        write_json_atomic(staging / "config.json", factory_config(cfg.model))
        return
    hf_config: Any = base_model(reference).config
    hf_config.dtype = cfg.export.dtype
    hf_config.save_pretrained(str(staging))
    GenerationConfig.from_model_config(hf_config).save_pretrained(str(staging))


def _write_adapter(src: Path, staging: Path, reference: torch.nn.Module, cfg: PipelineConfig) -> list[str]:
    """``adapter/``: the LoRA weights alone and their ``adapter_config.json``, as ``peft`` saves an adapter."""
    out = staging / ADAPTER_DIR
    out.mkdir()
    peft_config: Any = reference.peft_config["default"]  # type: ignore[index, union-attr]
    peft_config.base_model_name_or_path = cfg.model.pretrained
    peft_config.save_pretrained(str(out))
    tensors = adapter_tensors(_stored_shapes(src), reference)
    files = _write(src, out, cfg.export, tensors, index=None, stem="adapter_model")
    return [f"{ADAPTER_DIR}/{f}" for f in [*files, "adapter_config.json"]]


def run(ctx: TaskContext) -> dict[str, object]:
    cfg, layout = ctx.cfg, ctx.layout
    source = _source(cfg, layout)
    step = int(str(source["step"]))
    weights = layout.consolidated_step(step) / CONSOLIDATED_WEIGHTS
    tokenizer = load_tokenizer(layout.assets)
    reference = check_fits_model(weights, cfg.model, tokenizer)  # before anything is written
    with staging_dir(layout.export, step_name(step)) as staging:
        files = _write(weights, staging, cfg.export, export_tensors(_stored_shapes(weights), reference))
        _write_config(staging, reference, cfg)
        tokenizer.save_pretrained(str(staging))
        if cfg.export.adapter and cfg.model.lora.r:
            files += _write_adapter(weights, staging, reference, cfg)
        files = sorted({*files, *(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())})
        extra = {"run_id": layout.run_id, "source_dir": f"checkpoints/{step_name(step)}", "format": "huggingface"}
        finish(staging, layout.export_step(step), MARKER, source, files, extra)
    return {"step": step, "out": str(layout.export_step(step)), "files": len(files), "source": json.dumps(source)}
