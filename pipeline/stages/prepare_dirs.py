"""prepare-dirs: fix the run directory before any rank starts.

Inputs: the resolved config and the run id chosen by the launching process.
Outputs: the layout (``stages/ checkpoints/{staging,quarantine}/ consolidated/ export/``) and ``assets/``
(tokenizer, token stream, ``data.json`` fingerprints of the source files; token files are read in place;
published by one rename). ``run.yaml`` is the launching process's: kept by
``run.overwrite``, like the lease, ``logs/`` and ``.hydra/``.
Owner: this single task is the only one that deletes anything (``run.overwrite=true``), before any rank runs.
Done-marker: the planned directories exist and ``assets/assets.json`` verifies.
"""

from __future__ import annotations

import dataclasses

from pipeline.checkpoint.outputs import finish, staging_dir, verified_output
from pipeline.config.schema import PipelineConfig
from pipeline.errors import UnsafePathError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import Resources, StageContract, TaskContext
from pipeline.storage.atomic import clear_file, remove_tree
from pipeline.storage.integrity import is_real_dir, lstat_kind, not_real_dirs

CONTRACT = StageContract(
    name="prepare_dirs",
    needs=(),
    reads="config",
    produces="run dir layout, assets/ (tokenizer, tokens)",
    marker="run.yaml + assets/assets.json",
    resources=Resources(cpus_per_task=1, mem_gb=2, timeout_min=10),
    creates_run=True,
    writes_bytes=lambda cfg: cfg.data.num_documents * cfg.data.seq_len * 8,  # corpus, tokens, tokenizer (estimate)
)

ASSETS_MARKER = "assets.json"


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    """Nothing to check: this stage makes the layout (the run's identity is checked by the launching process)."""


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    if cfg.run.overwrite:
        return None
    if not_real_dirs(layout.planned_dirs()):
        return None
    if not _assets_ok(cfg, layout):
        return None
    return "the layout exists and assets verify"


def _assets_source(cfg: PipelineConfig) -> dict[str, object]:
    source: dict[str, object] = {"data": dataclasses.asdict(cfg.data)}
    if cfg.model.pretrained:  # its tokenizer is the run's unless data.tokenizer is set
        source["tokenizer_of"] = cfg.model.pretrained
    return source


def _assets_ok(cfg: PipelineConfig, layout: RunLayout) -> bool:
    return verified_output(layout.assets, ASSETS_MARKER, _assets_source(cfg))


def run(ctx: TaskContext) -> dict[str, object]:
    layout, cfg = ctx.layout, ctx.cfg
    if cfg.run.overwrite and layout.run_dir.exists():
        # The one deletion in the pipeline. The launching process's own entries stay: its lease, logs/ (this
        # very job's log folder is there), .hydra/ and run.yaml, the run's record. run.yaml is never deleted:
        # only the launching process writes it, and a launch that does not rewrite it (stage=prepare_dirs, or a
        # SLURM chain the launch does not wait for) would leave a run whose id is unknown.
        kept = layout.launch_owned()
        for entry in layout.run_dir.iterdir():
            if entry.name not in kept:
                remove_tree(entry) if is_real_dir(entry) else clear_file(entry)
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    for d in layout.planned_dirs():
        if lstat_kind(d) not in (None, "dir"):
            raise UnsafePathError(
                f"{d} is a {lstat_kind(d)}, where the run keeps a directory of its own (links are never followed): "
                f"move it away, or start over with run.overwrite=true"
            )
        d.mkdir(exist_ok=True)
    built_assets = not _assets_ok(cfg, layout)
    if built_assets:
        with staging_dir(layout.run_dir, layout.assets.name) as staging:
            from pipeline.workload.corpus import build_assets  # noqa: PLC0415 - torch/tokenizers: only to build

            build_assets(cfg.data, staging, cfg.model.pretrained)
            files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
            finish(staging, layout.assets, ASSETS_MARKER, _assets_source(cfg), files, {})
    return {"run_dir": str(layout.run_dir), "built_assets": built_assets}
