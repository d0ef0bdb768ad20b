"""export: consolidated step -> Hugging Face layout that ``from_pretrained`` loads offline.

Inputs: ``consolidated/step_N/`` (verified against its marker, which must name latest's manifest hash),
``assets/tokenizer``, the model config.
Outputs: ``export/step_N/``: ``model-0000i-of-0000n.safetensors`` shards no larger than
``export.max_shard_size`` (a tensor larger than that gets a shard of its own), ``model.safetensors.index.json``,
``config.json``, ``generation_config.json``, tokenizer files, and ``provenance.json`` (done-marker: source
step, manifest hash, consolidated file hash, export settings, every file's size and hash).
Before anything is written, the consolidated tensors' names and shapes must be exactly those of the model the config
describes (an imported checkpoint of another architecture fails here in one line, naming the first difference).
Owner: this single task. Memory: one tensor at a time (read through safetensors' mmap).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
from pipeline.errors import CheckpointFormatError, ConfigError, PipelineError, VerificationError
from pipeline.formats.safetensors_shards import write_sharded
from pipeline.orchestration.contract import Resources, StageContract, TaskContext
from pipeline.storage.atomic import read_json
from pipeline.storage.layout import RunLayout, step_name
from pipeline.workload.data import load_tokenizer
from pipeline.workload.model import llama_config
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


def _expected_shapes(model: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the configured model loads (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        reference = LlamaForCausalLM(llama_config(model, tokenizer))
    return {name: tuple(t.shape) for name, t in reference.state_dict().items()}


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


def check_fits_model(src: Path, model: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> None:
    """Refuse weights that the model of this run's config cannot load (the first difference, in name order)."""
    stored, expected = _stored_shapes(src), _expected_shapes(model, tokenizer)
    for name in sorted(stored.keys() | expected.keys()):
        if name not in stored:
            problem = f"has no tensor {name}, which the configured model needs (shape {expected[name]})"
        elif name not in expected:
            problem = f"has tensor {name} {stored[name]}, which the configured model does not have"
        elif stored[name] != expected[name]:
            problem = f"has tensor {name} of shape {stored[name]}, but the configured model expects {expected[name]}"
        else:
            continue
        sizes = ", ".join(
            f"model.{k}={getattr(model, k)}"
            for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
        )
        raise ConfigError(
            f"{src} {problem} ({sizes}, vocab {len(tokenizer)}): the weights do not fit the model this run's "
            "config describes; choose the +experiment / model.* overrides that match the imported checkpoint (in a new "
            "run, or with run.overwrite=true)"
        )


def _write_weights(src: Path, staging: Path, export: ExportConfig) -> list[str]:
    try:
        return write_sharded(src, staging, getattr(torch, export.dtype), parse_size(export.max_shard_size))
    except SafetensorError as e:
        raise _unreadable(src, e) from None


def run(ctx: TaskContext) -> dict[str, object]:
    cfg, layout = ctx.cfg, ctx.layout
    source = _source(cfg, layout)
    step = int(str(source["step"]))
    weights = layout.consolidated_step(step) / CONSOLIDATED_WEIGHTS
    tokenizer = load_tokenizer(layout.assets)
    check_fits_model(weights, cfg.model, tokenizer)  # before anything is written
    with staging_dir(layout.export, step_name(step)) as staging:
        files = _write_weights(weights, staging, cfg.export)
        hf_config = llama_config(cfg.model, tokenizer)
        hf_config.dtype = cfg.export.dtype
        hf_config.save_pretrained(str(staging))
        GenerationConfig.from_model_config(hf_config).save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        files = sorted({*files, *(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())})
        extra = {"run_id": layout.run_id, "source_dir": f"checkpoints/{step_name(step)}", "format": "huggingface"}
        finish(staging, layout.export_step(step), MARKER, source, files, extra)
    return {"step": step, "out": str(layout.export_step(step)), "files": len(files), "source": json.dumps(source)}
