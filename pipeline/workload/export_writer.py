"""What the export stage writes: the run's model checked against the consolidated weights (on the meta device),
the weights as sharded safetensors in the export dtype, the model's config, the tokenizer and a LoRA adapter.
Imported by :mod:`pipeline.stages.export`'s job only (it loads ``torch`` and ``transformers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from pipeline.checkpoint.outputs import CONSOLIDATED_WEIGHTS, finish, staging_dir
from pipeline.config.schema import ExportConfig, ModelConfig, PipelineConfig, parse_size
from pipeline.formats.safetensors_shards import stored_shapes, write_sharded
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import write_json_atomic
from pipeline.storage.layout import step_name
from pipeline.workload.corpus import load_tokenizer
from pipeline.workload.exported import ExportTensor, adapter_tensors, check_fits, export_tensors, model_hint
from pipeline.workload.model import base_model, build_model, factory_config, is_transformers

ADAPTER_DIR = "adapter"


def check_fits_model(src: Path, model: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    """The run's model on the meta device, once the stored weights are known to fit it (else a one-line error)."""
    reference = build_model(model, tokenizer, meta=True)
    check_fits(stored_shapes(src), reference, str(src), model_hint(model, tokenizer))
    return reference


def write_weights(src: Path, staging: Path, export: ExportConfig, tensors: list[ExportTensor], **kw: Any) -> list[str]:
    plan = [(t.name, t.shape, t.read) for t in tensors]
    return write_sharded(src, staging, getattr(torch, export.dtype), parse_size(export.max_shard_size), plan, **kw)


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
    tensors = adapter_tensors(stored_shapes(src), reference)
    files = write_weights(src, out, cfg.export, tensors, index=None, stem="adapter_model")
    return [f"{ADAPTER_DIR}/{f}" for f in [*files, "adapter_config.json"]]


def write_export(cfg: PipelineConfig, layout: RunLayout, source: dict[str, object], marker: str) -> list[str]:
    """``export/step_N/`` of ``source``'s step, published with its done-marker ``marker``; the files written."""
    step = int(str(source["step"]))
    weights = layout.consolidated_step(step) / CONSOLIDATED_WEIGHTS
    tokenizer = load_tokenizer(layout.assets)
    reference = check_fits_model(weights, cfg.model, tokenizer)  # before anything is written
    with staging_dir(layout.export, step_name(step)) as staging:
        files = write_weights(weights, staging, cfg.export, export_tensors(stored_shapes(weights), reference))
        _write_config(staging, reference, cfg)
        tokenizer.save_pretrained(str(staging))
        if cfg.export.adapter and cfg.model.lora.r:
            files += _write_adapter(weights, staging, reference, cfg)
        files = sorted({*files, *(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())})
        extra = {"run_id": layout.run_id, "source_dir": f"checkpoints/{step_name(step)}", "format": "huggingface"}
        finish(staging, layout.export_step(step), marker, source, files, extra)
    return files
