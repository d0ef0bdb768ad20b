"""``run.yaml``: the resolved config a run was created with, and which parts of it fix the run's identity."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from pipeline.config.schema import PipelineConfig
from pipeline.storage.layout import RunLayout

# Keys that may differ between invocations of one run (how it is launched, what to redo, deadlines, export).
_VOLATILE = {
    "stage",
    "force",
    "dry_run",
    "run.overwrite",
    "run.root",
    "launcher",
    "train.stop_after_step",
    "checkpoint.marker_deadline_s",
    "checkpoint.fail_on_save_error",
    "export",
    "strategy.pg_timeout_s",
}


def as_dict(cfg: PipelineConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def identity(cfg_dict: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in cfg_dict.items():
        full = f"{prefix}{key}"
        if full in _VOLATILE:
            continue
        if isinstance(value, dict):
            out.update(identity(value, f"{full}."))
        else:
            out[full] = value
    return out


def render(cfg: PipelineConfig) -> bytes:
    return yaml.safe_dump(as_dict(cfg), sort_keys=True).encode()


def read_run_yaml(layout: RunLayout) -> dict[str, Any]:
    with open(layout.run_yaml, "rb") as f:
        data = yaml.safe_load(f)
    return data if isinstance(data, dict) else {}


def differences(cfg: PipelineConfig, recorded: dict[str, Any]) -> list[str]:
    new, old = identity(as_dict(cfg)), identity(recorded)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(new) | set(old)) if new.get(k) != old.get(k)]
