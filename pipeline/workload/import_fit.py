"""Before any job of an import runs: will its export work? The model tensors of ``import.source`` (names and
shapes, read with the restricted readers: DCP metadata, the lazy torch.save reader) must fit the run's model
route, built on the meta device; else the launch is refused in one line instead of failing at export, four
stages later. DeepSpeed sources, and a tokenizer that only prepare-dirs can make (one trained on local files),
leave the check to the export stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config.schema import PipelineConfig
from pipeline.formats.registry import TORCH_SAVE
from pipeline.rundir.layout import RunLayout
from pipeline.workload.exported import check_fits, model_hint


def source_shapes(fmt: str, root: Path, files: dict[str, str], allow_pickle: bool) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of the model tensors consolidation will write from the source (None: not read up front)."""
    if fmt == "torch_dcp":
        from pipeline.formats.dcp import read_metadata_safe  # noqa: PLC0415
        from pipeline.formats.dcp_metadata import tensor_entries  # noqa: PLC0415
        from pipeline.formats.dcp_stream import MODEL_PREFIX  # noqa: PLC0415

        md = read_metadata_safe(root)
        return {k[len(MODEL_PREFIX) :]: tuple(m.size) for k, m in tensor_entries(md, MODEL_PREFIX)} or None
    if fmt == TORCH_SAVE:
        from pipeline.formats.torch_save import FILE, model_weights  # noqa: PLC0415
        from pipeline.formats.torch_zip import load_lazy  # noqa: PLC0415

        path = root / files[FILE]
        weights = model_weights(load_lazy(path, allow_pickle=allow_pickle), path)
        return {name: tuple(t.shape) for name, t in weights.items()}
    return None


def _plan_tokenizer(cfg: PipelineConfig, layout: RunLayout) -> Any:
    """The tokenizer the run will have, where it is known before prepare-dirs runs (else None)."""
    from pipeline.workload import corpus  # noqa: PLC0415

    if (layout.assets / corpus.TOKENIZER_DIR).is_dir():
        return corpus.load_tokenizer(layout.assets)
    given = corpus.tokenizer_source(cfg.data, cfg.model.pretrained)
    if given is not None:
        return corpus._load_tokenizer_dir(given)
    if cfg.data.source == "synthetic":
        return corpus.train_tokenizer(corpus.generate_corpus(cfg.data), cfg.data)
    return None


def check_exportable(cfg: PipelineConfig, layout: RunLayout, shapes: dict[str, tuple[int, ...]] | None) -> None:
    if cfg.export.format == "none" or not shapes:
        return
    tokenizer = _plan_tokenizer(cfg, layout)
    if tokenizer is None:
        return
    from pipeline.workload.model import build_model  # noqa: PLC0415

    reference = build_model(cfg.model, tokenizer, meta=True)
    check_fits(shapes, reference, f"import.source={cfg.import_.source}", model_hint(cfg.model, tokenizer))
