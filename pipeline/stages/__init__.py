"""Stages in DAG order. Each module states its inputs, outputs, owner and done-marker in its docstring."""

from __future__ import annotations

from pipeline.contract import StageModule
from pipeline.stages import consolidate, export, prepare_dirs, train, verify_manifest

ORDER: tuple[str, ...] = ("prepare_dirs", "train", "verify_manifest", "consolidate", "export")
"""Stages the DAG launches as jobs; shard-save runs inside train on every rank (see shard_save.CONTRACT)."""

STAGES: dict[str, StageModule] = {
    "prepare_dirs": prepare_dirs,
    "train": train,
    "verify_manifest": verify_manifest,
    "consolidate": consolidate,
    "export": export,
}
