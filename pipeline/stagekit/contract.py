"""The stage contract: data that the runner, launchers, dry-run and tests read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipeline.config.schema import PipelineConfig
    from pipeline.rundir.layout import RunLayout

ORDER: tuple[str, ...] = ("prepare_dirs", "import_checkpoint", "train", "verify_manifest", "consolidate", "export")
"""Stages the DAG launches as jobs (:mod:`pipeline.stages` maps each name to its module); shard-save runs inside
train on every rank (see shard_save.CONTRACT). A run either trains or imports (``import.source``): the other
stage is skipped as done."""
OPTIONAL: frozenset[str] = frozenset({"import_checkpoint"})
"""The stages whose contract says ``optional``, by name: what ``python -m pipeline.status`` needs without importing
the stage modules (``tests/test_structure.py`` checks that the two agree)."""


@dataclass(frozen=True)
class Resources:
    """What one task of a stage needs; :func:`launchers.resources.submitit_parameters` maps it to submitit."""

    cpus_per_task: int = 1
    """CPU cores per task."""
    mem_gb: float = 4.0
    """Memory per task (GB)."""
    timeout_min: int = 60
    """Wall-clock limit of the job; the launcher cancels it past this plus ``launcher.deadline_grace_s``."""
    gpus_per_task: int = 0
    """GPUs per task (train on NCCL: one per rank)."""
    nodes: int = 1
    """Nodes of the job; its tasks are spread evenly over them."""
    gres: str | None = None
    """SLURM ``--gres`` instead of ``gpus_per_task``."""
    partition: str | None = None
    qos: str | None = None
    account: str | None = None
    constraint: str | None = None
    extra: tuple[tuple[str, str], ...] = ()
    """More sbatch options, (option, value) pairs."""


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
    creates_run: bool = False
    """The stage that makes the run dir's layout (and the only one that deletes, for ``run.overwrite``): it has
    no inputs to check and always runs when a run is started over."""
    sized_by: Callable[[PipelineConfig], Resources] | None = None
    """Resources that depend on the config (train's time budget, GPUs on NCCL); else ``resources``."""
    launched: bool = True
    """False for shard-save, which runs inside train on every rank and is never a job of its own."""
    beside: str | None = None
    """The stage this one runs beside (the committer beside train): both start together (SLURM ``after``),
    this one watches the other's job and finishes after it ends. Launched whenever that stage is."""
    writes_bytes: Callable[[PipelineConfig], int] | None = None
    """About how many bytes the stage writes for the whole run (``dry_run``'s estimate); None: small records."""
    reports_progress: bool = False
    """Its rank 0 appends progress events to ``metrics.jsonl`` that the launching process shows (train)."""
    check_before_launch: bool = False
    """Its inputs are checked in the launching process before any job is submitted (an import source that
    cannot be read is refused up front, not after prepare_dirs)."""
    optional: bool = False
    """Part of some runs only (the import): status lists it only once it has a record."""

    def bytes_written(self, cfg: PipelineConfig) -> int:
        return self.writes_bytes(cfg) if self.writes_bytes is not None else 4096  # a record

    def num_tasks(self, cfg: PipelineConfig) -> int:
        return cfg.strategy.world_size if self.distributed else 1

    def resources_for(self, cfg: PipelineConfig) -> Resources:
        return self.sized_by(cfg) if self.sized_by is not None else self.resources

    @property
    def job_name(self) -> str:
        return self.name.replace("_", "-")


@dataclass(frozen=True)
class JobRef:
    """A submitted job, as a stage beside it sees it: which scheduler, its id, and its launch id (attempt)."""

    stage: str
    cluster: str
    job_id: str
    attempt: str


@dataclass(frozen=True)
class TaskContext:
    """What one task of a stage job receives: the run is fixed before any task starts (never derived here)."""

    cfg: PipelineConfig
    layout: RunLayout
    attempt: str
    """Launch id decided by the launching process; markers carry it so stale ones from an older try are ignored."""
    rank: int = 0
    world_size: int = 1
    beside: JobRef | None = None
    """For a stage with ``beside`` set: the job it runs beside (the committer watches train's job)."""


class StageModule(Protocol):
    CONTRACT: StageContract

    def check_inputs(self, cfg: PipelineConfig, layout: RunLayout) -> None: ...

    def is_done(self, cfg: PipelineConfig, layout: RunLayout) -> str | None: ...

    def run(self, ctx: TaskContext) -> dict[str, object]: ...
