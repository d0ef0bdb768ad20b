"""The stage contract: data that the runner, launchers, dry-run and tests read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipeline.config.schema import PipelineConfig
    from pipeline.storage.layout import RunLayout


@dataclass(frozen=True)
class Resources:
    """What one task of a stage needs; :func:`launchers.resources.submitit_parameters` maps it to submitit."""

    cpus_per_task: int = 1
    mem_gb: float = 4.0
    timeout_min: int = 60


@dataclass(frozen=True)
class StageContract:
    name: str
    """snake_case id used in config (``stage=<name>``) and records; job names use the kebab-case form."""
    needs: tuple[str, ...]
    """Stages whose outputs this one reads."""
    reads: str
    """What it reads, for people."""
    produces: str
    """What it writes, for people."""
    marker: str
    """The file whose presence (with verified content) says the stage's output is complete."""
    distributed: bool = False
    """True: one task per training rank (``strategy.world_size``); false: exactly one task."""
    resources: Resources = Resources()
    after_any: bool = False
    """Run even when an earlier stage failed (SLURM ``afterany``): a failed train still gets its complete steps
    committed. Stages without it are skipped after a failure."""

    def num_tasks(self, cfg: PipelineConfig) -> int:
        return cfg.strategy.world_size if self.distributed else 1

    @property
    def job_name(self) -> str:
        return self.name.replace("_", "-")


@dataclass(frozen=True)
class TaskContext:
    """What one task of a stage job receives: the run is fixed before any task starts (never derived here)."""

    cfg: PipelineConfig
    layout: RunLayout
    attempt: str
    """Launch id decided by the launching process; markers carry it so stale ones from an older try are ignored."""
    rank: int = 0
    world_size: int = 1


class StageModule(Protocol):
    CONTRACT: StageContract

    def check_inputs(self, cfg: PipelineConfig, layout: RunLayout) -> None: ...

    def is_done(self, cfg: PipelineConfig, layout: RunLayout) -> str | None: ...

    def run(self, ctx: TaskContext) -> dict[str, object]: ...
