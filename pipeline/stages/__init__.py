"""Stages in DAG order. Each module states its inputs, outputs, owner and done-marker in its docstring.

Modules are imported on first use, so a job imports only its own stage (consolidate never loads
``transformers``; train never loads the export code).
"""

from __future__ import annotations

import importlib
from typing import cast

from pipeline.stagekit.contract import ORDER, StageModule

__all__ = ["INSIDE", "ORDER", "get_stage"]


INSIDE: tuple[str, ...] = ("shard_save",)
"""Stages with a contract that run inside another stage's job, never as a job of their own."""


def get_stage(name: str) -> StageModule:
    if name not in ORDER + INSIDE:
        raise KeyError(name)
    return cast(StageModule, importlib.import_module(f"pipeline.stages.{name}"))
