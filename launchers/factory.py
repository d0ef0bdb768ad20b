"""Pick the launcher named by ``launcher.kind``."""

from __future__ import annotations

from launchers.base import Launcher
from launchers.inprocess import InProcessLauncher
from launchers.submitit_launcher import SubmititLauncher
from pipeline.config.launcher import LauncherConfig
from pipeline.errors import ConfigError


def make_launcher(cfg: LauncherConfig) -> Launcher:
    if cfg.kind == "local":
        return SubmititLauncher(cfg, cluster="local")
    if cfg.kind == "inprocess":
        return InProcessLauncher()
    if cfg.kind == "slurm":
        return SubmititLauncher(cfg, cluster="slurm")  # untested until the SLURM issue: no dependency chaining yet
    raise ConfigError(f"launcher.kind={cfg.kind!r}: choose launcher=local, launcher=inprocess or launcher=slurm")
