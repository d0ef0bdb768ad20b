"""prepare-dirs: fix the run directory before any rank starts.

Inputs: the resolved config and the run id chosen by the launching process.
Outputs: the layout (``stages/ checkpoints/{staging,quarantine}/ consolidated/ export/``), ``run.yaml``, and
``assets/`` (tokenizer + token stream, published by one rename).
Owner: this single task is the only one that deletes anything (``run.overwrite=true``), before any rank runs.
Done-marker: ``run.yaml`` matching the config's identity keys, and ``assets/assets.json`` verifying.
"""

from __future__ import annotations

import os

from pipeline.atomic import clear_file, publish_dir, read_json, remove_tree, write_bytes_atomic, write_json_atomic
from pipeline.config import PipelineConfig
from pipeline.contract import Resources, StageContract, TaskContext
from pipeline.data import build_assets
from pipeline.errors import ConfigError, VerificationError
from pipeline.integrity import FileEntry, describe, verify_entries
from pipeline.layout import RunLayout
from pipeline.runconfig import differences, read_run_yaml, render

CONTRACT = StageContract(
    name="prepare_dirs",
    needs=(),
    reads="config",
    produces="run dir layout, run.yaml, assets/ (tokenizer, tokens)",
    marker="run.yaml + assets/assets.json",
    resources=Resources(cpus_per_task=1, mem_gb=2, timeout_min=10),
)

ASSETS_MARKER = "assets.json"


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    if layout.run_yaml.exists() and not cfg.run.overwrite:
        diff = differences(cfg, read_run_yaml(layout))
        if diff:
            raise ConfigError(
                f"run {layout.run_dir} was created with a different config ({'; '.join(diff)}): "
                "use a new run.id, or run.overwrite=true to delete the old run"
            )


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    if cfg.run.overwrite or not layout.run_yaml.exists():
        return None
    if differences(cfg, read_run_yaml(layout)):
        return None
    if any(not d.is_dir() for d in layout.planned_dirs()):
        return None
    try:
        _verify_assets(layout)
    except (VerificationError, OSError, ValueError):
        return None
    return f"{layout.run_yaml} matches the config and assets verify"


def _verify_assets(layout: RunLayout) -> None:
    marker = layout.assets / ASSETS_MARKER
    if not marker.exists():
        raise VerificationError(f"{marker} is missing")
    entries = [FileEntry.from_json(e, str(marker)) for e in read_json(marker)["files"]]
    verify_entries(layout.assets, entries, str(marker))


def run(ctx: TaskContext) -> dict[str, object]:
    layout, cfg = ctx.layout, ctx.cfg
    if cfg.run.overwrite and layout.run_dir.exists():
        # The one deletion in the pipeline: everything but logs/ (this very job's log folder lives there).
        for entry in layout.run_dir.iterdir():
            if entry.name != layout.logs.name:
                remove_tree(entry) if entry.is_dir() else clear_file(entry)
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    for d in layout.planned_dirs():
        if d != layout.assets:
            d.mkdir(parents=True, exist_ok=True)
    os.chmod(layout.logs, 0o700)  # submitit job folders hold pickles
    check_inputs(cfg, layout)
    if not layout.run_yaml.exists():
        write_bytes_atomic(layout.run_yaml, render(cfg))
    built_assets = False
    try:
        _verify_assets(layout)
    except (VerificationError, OSError, ValueError):
        staging = layout.run_dir / ".assets.staging"
        if staging.exists():
            remove_tree(staging)
        if layout.assets.exists():
            remove_tree(layout.assets)  # unverifiable leftovers from a crashed attempt; owner is this task
        staging.mkdir()
        build_assets(cfg.data, staging)
        files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
        write_json_atomic(staging / ASSETS_MARKER, {"files": [describe(staging, f).to_json() for f in files]})
        publish_dir(staging, layout.assets)
        built_assets = True
    return {"run_dir": str(layout.run_dir), "built_assets": built_assets}
