"""Run dirs on disk: finding one under a root by its id, and reading its ``run.yaml`` as plain data.

Shared by the launch (``run.id=<id>``, :mod:`pipeline.config.overrides`; the typed record is
:class:`pipeline.config.identity.RunRecord`) and by ``python -m pipeline.status``, which reads runs without
composing a config: nothing here imports Hydra or the config schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, RunNotFoundError
from pipeline.rundir.layout import RUN_YAML

LAST = "last"
"""The run id that names the newest run."""
DEFAULT_ROOT = "outputs"
"""``run.root``'s default: runs live in ``<root>/<experiment>/<run_id>``."""


@dataclass(frozen=True)
class RunYaml:
    """The content of ``run.yaml``, as read (see :mod:`pipeline.config.identity` for what each part means)."""

    config: dict[str, Any]
    overrides: list[str]
    history: list[dict[str, Any]] = field(default_factory=list)


def read_run_yaml(path: Path) -> RunYaml:
    """``run.yaml`` at ``path``; ConfigError (one line) when it is missing, a symlink or malformed."""
    import yaml  # noqa: PLC0415 - the app's (the library's command lines read no run.yaml)

    try:
        if path.is_symlink():
            raise ConfigError(f"{path} is a symlink: run.yaml must be a regular file written by the pipeline")
        with open(path, "rb") as f:
            data = yaml.safe_load(f)
        config, overrides = data["config"], data["overrides"]
        if not isinstance(config, dict) or not isinstance(overrides, list):
            raise TypeError("config must be a mapping and overrides a list")
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read the run record {path}: {e}; it is written by the launching process") from e
    history = data.get("history") or []
    if not isinstance(history, list):
        raise ConfigError(f"cannot read the run record {path}: history must be a list")
    return RunYaml(config=config, overrides=[str(o) for o in overrides], history=history)


def _runs(root: Path, experiment: str | None) -> list[Path]:
    if not root.is_dir():
        return []
    pattern = f"{experiment}/*/{RUN_YAML}" if experiment else f"*/*/{RUN_YAML}"
    return [p.parent for p in root.glob(pattern) if p.is_file() and not p.is_symlink()]


def newest_runs(root: Path, experiment: str | None, n: int = 5) -> list[Path]:
    return sorted(_runs(root, experiment), key=lambda d: (d / RUN_YAML).stat().st_mtime, reverse=True)[:n]


def locate_run(
    run_id: str, root: Path, experiment: str | None, how_to_pick: str = "add +experiment=<name>"
) -> Path | None:
    """The one run-id resolver (the CLI's ``run.id`` and ``python -m pipeline.status`` alike): the run dir of
    ``run_id`` (``last``: the newest run) under ``root`` (one experiment, or every one), or None when unknown;
    ``run.id=last`` with no run at all, and an id in several experiments, are errors (``how_to_pick`` says how
    to choose the experiment)."""
    if run_id == LAST:
        newest = newest_runs(root, experiment, 1)
        if not newest:
            where = root / experiment if experiment else root
            raise RunNotFoundError(f"run.id=last: no run under {where}; start one with +experiment=<name>")
        return newest[0]
    matches = [d for d in _runs(root, experiment) if d.name == run_id]
    if len(matches) > 1:
        exps = ", ".join(sorted(d.parent.name for d in matches))
        raise ConfigError(f"run id {run_id!r} exists in several experiments ({exps}): {how_to_pick}")
    return matches[0] if matches else None
