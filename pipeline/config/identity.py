"""``run.yaml``: what a run was created with, and which parts of it fix the run's identity.

Written by the launching process (the run's lease holder) before any job starts, and rewritten when a later
launch changes a recorded, non-identity value (``train.steps=16`` extends a run). It holds:

* ``config``: the resolved config of the newest launch (everything below the entry point reads typed configs);
* ``overrides``: the command-line overrides a continuation (``run.id=<id>``) replays, so no original override
  has to be repeated. Per-launch keys (``stage``, ``force``, ``run.*``, ``train.stop_after_step``...) are left out.

Which fields are identity, recorded-but-mutable, or per-launch is marked on the dataclass fields themselves
(:data:`pipeline.config.schema.MUTABLE`, :data:`~pipeline.config.schema.PER_LAUNCH`). The global batch is
identity as the number of samples per step, however it was given: ``train.global_batch_size``, or when that is
null ``train.micro_batch_size`` x ``strategy.world_size``. So a continuation at another world size keeps it
(:func:`kept_global_batch`): ``strategy.*`` may change, the optimisation may not.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from pipeline.config.schema import PipelineConfig
from pipeline.errors import ConfigError
from pipeline.rundir.layout import RunLayout
from pipeline.rundir.runs import read_run_yaml
from pipeline.storage.atomic import write_bytes_atomic


def _walk(schema: type, prefix: str = "") -> dict[str, dict[str, Any]]:
    """Dotted key -> field metadata, for every field of the schema tree (an ``Any`` subtree is one key)."""
    hints = typing.get_type_hints(schema)
    out: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        out[key] = dict(f.metadata)
        sub = hints[f.name]
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            for k, meta in _walk(sub, f"{key}.").items():
                out[k] = {**dict(f.metadata), **meta}  # a marked section marks everything under it
    return out


FIELD_META: dict[str, dict[str, Any]] = _walk(PipelineConfig)


def _covering(key: str) -> dict[str, Any]:
    """Metadata of ``key`` or of the nearest section above it that is in the schema."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        meta = FIELD_META.get(".".join(parts[:n]))
        if meta is not None:
            return meta
    return {}


def is_identity(key: str) -> bool:
    return _covering(key).get("identity", True) is not False


def is_per_launch(key: str) -> bool:
    return bool(_covering(key).get("per_launch", False))


def as_dict(cfg: PipelineConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{full}."))
        else:
            out[full] = value
    return out


GLOBAL_BATCH = "train.global_batch_size"


def global_batch(cfg_dict: dict[str, Any]) -> int | None:
    """Samples per optimizer step over all ranks: ``train.global_batch_size``, or when that is null (each rank
    takes ``train.micro_batch_size``) the micro batch times ``strategy.world_size``; None if neither is known."""
    train, strategy = cfg_dict.get("train") or {}, cfg_dict.get("strategy") or {}
    given = train.get("global_batch_size")
    if given is not None:
        return int(given)
    micro, world = train.get("micro_batch_size"), strategy.get("world_size")
    return micro * world if isinstance(micro, int) and isinstance(world, int) else None


def identity(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in _flatten(cfg_dict).items() if is_identity(k)}
    if GLOBAL_BATCH in out:
        out[GLOBAL_BATCH] = global_batch(cfg_dict)  # null and micro x world size: the same run
    return out


def kept_global_batch(cfg: PipelineConfig, recorded: dict[str, Any]) -> int | None:
    """The ``train.global_batch_size`` a continuation must be given to keep the run's global batch, or None when
    it keeps it already. That is the case to catch: the run's global batch was derived (``train.global_batch_size``
    null: micro batch x world size) and this launch changes ``strategy.world_size``, which would silently change
    the batch, the loss curve and the meaning of ``train.lr``. Refused when the new world size cannot split it."""
    if cfg.train.global_batch_size is not None:
        return None  # given: the identity check compares it
    old, world = global_batch(recorded), cfg.strategy.world_size
    if old is None or old == cfg.train.micro_batch_size * world:
        return None
    if old % world:
        old_world = (recorded.get("strategy") or {}).get("world_size")
        raise ConfigError(
            f"the run trains on a global batch of {old} samples per step (train.global_batch_size, derived from "
            f"train.micro_batch_size x strategy.world_size={old_world}), which strategy.world_size={world} does not "
            f"split evenly: choose a world size that divides {old}, or start a new run"
        )
    return old


def differences(cfg: PipelineConfig, recorded: dict[str, Any]) -> list[str]:
    """Identity keys whose value differs: ``key: run was created with X, this launch gives Y``."""
    new, old = identity(as_dict(cfg)), identity(recorded)
    return [
        f"{k}: the run was created with {old.get(k)!r}, this launch gives {new.get(k)!r}"
        for k in sorted(set(new) | set(old))
        if new.get(k) != old.get(k)
    ]


RECORDED_CHANGES = ("strategy.",)
"""Mutable sections whose every change between launches is kept in ``run.yaml``'s ``history`` (a run that
continued at another world size or under another strategy says when and from what)."""


def recorded_changes(cfg: PipelineConfig, recorded: dict[str, Any]) -> dict[str, list[Any]]:
    """``{key: [old, new]}`` for the keys under :data:`RECORDED_CHANGES` this launch changes."""
    new, old = _flatten(as_dict(cfg)), _flatten(recorded)
    keys = sorted(k for k in set(new) | set(old) if k.startswith(RECORDED_CHANGES))
    return {k: [old.get(k), new.get(k)] for k in keys if old.get(k) != new.get(k)}


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """The content of ``run.yaml``."""

    config: dict[str, Any]
    overrides: list[str]
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One entry per launch that changed a recorded section: ``{"time": ..., "changes": {key: [old, new]}}``."""

    def matches(self, cfg: PipelineConfig, overrides: list[str]) -> bool:
        """Same replayed overrides and same recorded values (per-launch keys aside): nothing to rewrite."""
        return overrides == self.overrides and _recorded(self.config) == _recorded(as_dict(cfg))


def _recorded(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in _flatten(cfg_dict).items() if not is_per_launch(k)}


def read_run_record(path: Path) -> RunRecord:
    """``run.yaml`` at ``path`` (:func:`pipeline.rundir.runs.read_run_yaml`: ConfigError when unreadable)."""
    data = read_run_yaml(path)
    return RunRecord(config=data.config, overrides=data.overrides, history=data.history)


def write_run_record(
    layout: RunLayout, cfg: PipelineConfig, overrides: list[str], history: list[dict[str, Any]] | None = None
) -> RunRecord:
    record = RunRecord(config=as_dict(cfg), overrides=overrides, history=list(history or []))
    body: dict[str, Any] = {"config": record.config, "overrides": record.overrides}
    if record.history:
        body["history"] = record.history
    text = yaml.safe_dump(body, sort_keys=True)
    write_bytes_atomic(layout.run_yaml, text.encode())
    return record
