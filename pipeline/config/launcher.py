"""Typed configuration of how stage jobs are launched: the ``launcher`` config group (``conf/launcher/``).

One dataclass per option of the group (Hydra's submitit plugin does the same): a base every launcher shares,
specialised into the local launcher (``local``, and ``inprocess`` for tests) and SLURM; each holds per-stage
resource overrides over the stage contracts' defaults. ``launchers/resources.py`` maps them to submitit's
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from pipeline.checkpoint import options
from pipeline.errors import ConfigError


@dataclass
class StageResourcesConfig:
    """Overrides of one stage's resources; null keeps the stage contract's default (see ``dry_run=true``)."""

    time_min: int | None = None
    """Wall-clock limit of the job in minutes (SLURM ``--time``); train's default is ``train.time_limit_min``."""
    cpus_per_task: int | None = None
    """CPU cores per task."""
    mem_gb: float | None = None
    """Memory per task in GB (SLURM asks for it per node: times the tasks on a node)."""
    gpus_per_task: int | None = None
    """GPUs per task (train on NCCL: 1)."""
    nodes: int | None = None
    """Nodes of the job (train only: its ``strategy.world_size`` tasks are spread evenly over them)."""
    gres: str | None = None
    """SLURM ``--gres`` (e.g. ``gpu:a100:4``), instead of ``gpus_per_task``."""
    partition: str | None = None
    """SLURM partition of this stage (default: ``launcher.partition``)."""
    qos: str | None = None
    """SLURM QOS of this stage (default: ``launcher.qos``)."""
    account: str | None = None
    """SLURM account of this stage (default: ``launcher.account``)."""
    constraint: str | None = None
    """SLURM ``--constraint`` of this stage (default: ``launcher.constraint``)."""
    extra: dict[str, str] = field(default_factory=dict)
    """More sbatch options of this stage, ``{option: value}`` without ``--`` (merged over ``launcher.extra``)."""

    def __post_init__(self) -> None:
        for key in ("time_min", "cpus_per_task", "nodes"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"launcher.stages.*.{key}={value} must be >= 1 (or null for the default)")
        for key in ("mem_gb", "gpus_per_task"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ConfigError(f"launcher.stages.*.{key}={value} must be >= 0 (or null for the default)")


@dataclass
class StagesResourcesConfig:
    """Per-stage resource overrides: ``launcher.stages.<stage>.<key>=<value>``."""

    prepare_dirs: StageResourcesConfig = field(default_factory=StageResourcesConfig)
    """prepare-dirs (one task)."""
    train: StageResourcesConfig = field(default_factory=StageResourcesConfig)
    """train (``strategy.world_size`` tasks)."""
    verify_manifest: StageResourcesConfig = field(default_factory=StageResourcesConfig)
    """The committer (one task, runs beside train)."""
    consolidate: StageResourcesConfig = field(default_factory=StageResourcesConfig)
    """consolidate (one task)."""
    export: StageResourcesConfig = field(default_factory=StageResourcesConfig)
    """export (one task)."""


@dataclass
class LauncherConfig:
    """Base launcher options shared by every launcher."""

    kind: str = MISSING
    """Which launcher: ``local`` (submitit local executor, separate processes), ``inprocess`` (tests), ``slurm``."""
    deadline_grace_s: float = 300.0
    """A job running this long past its stage's time limit (``train.time_limit_min`` for train) is cancelled."""
    poll_interval_s: float = 0.5
    """How often the launcher polls job state."""
    progress_interval_s: float = 30.0
    """Without a terminal (logs, SLURM): seconds between plain progress lines of train."""
    cancel_timeout_s: float = 30.0
    """On Ctrl-C/SIGTERM or a deadline: how long cancelled jobs get to exit before they are killed."""
    peer_grace_s: float = 60.0
    """Local multi-task jobs (train): once one task has ended (failed, died, or finished), how long the others
    may keep running before the job is cancelled and the first to end is reported (a peer stopped, or blocked
    in a collective, would otherwise hold the job until its time limit). On SLURM: how long a job of several tasks
    whose task 0 has a result while another has none (killed with its node) is left to SLURM, which may end it
    ``NODE_FAIL`` and requeue it, before the launcher reports the task (keep it above ``SlurmdTimeout``)."""
    stages: StagesResourcesConfig = field(default_factory=StagesResourcesConfig)
    """Resources of each stage's job, over the stage contract's defaults."""

    def __post_init__(self) -> None:
        keys = ("deadline_grace_s", "poll_interval_s", "progress_interval_s", "cancel_timeout_s", "peer_grace_s")
        for key in keys:  # poll_interval_s is also the committer's (CommitPolicy.poll_interval_s): one validator
            options.check_seconds(getattr(self, key), f"launcher.{key}")


@dataclass
class LocalLauncherConfig(LauncherConfig):
    kind: str = "local"
    master_addr: str = "127.0.0.1"
    """Rendezvous address for multi-task jobs; a literal IP so a hostname lookup cannot stall start-up."""
    fork_tasks: bool = True
    """A CPU job of several tasks (train on gloo) imports torch and the model's code once in its controller and
    forks its ranks from it, instead of each rank importing them again (about 6 CPU-s a rank). false: each task
    is a new interpreter, as submitit starts it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in ("local", "inprocess"):
            raise ConfigError(f"launcher.kind={self.kind!r}: the local launcher config takes 'local' or 'inprocess'")


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """SLURM through submitit: every stage is one sbatch job, chained by dependencies (``afterok``; the
    committer starts beside train with ``after``); the launch submits the chain and exits unless ``wait``."""

    kind: str = "slurm"
    partition: str | None = None
    """SLURM partition for every stage job (null: the cluster's default partition)."""
    account: str | None = None
    """SLURM account, if the cluster needs one."""
    qos: str | None = None
    """SLURM QOS for every stage job."""
    constraint: str | None = None
    """SLURM ``--constraint`` for every stage job."""
    extra: dict[str, str] = field(default_factory=dict)
    """More sbatch options for every job, ``{option: value}`` without ``--`` (e.g. ``{mail-type: END}``)."""
    wait: bool = False
    """false: submit the chain, print the job ids and the status command, exit. true: wait and report like the
    local launcher (Ctrl-C cancels the chain; the committer still commits what is complete)."""
    max_num_timeout: int = 3
    """How many times train may requeue itself on its time limit or a preemption (submitit's countdown)."""
    signal_delay_s: int = 90
    """Seconds before the time limit at which SLURM sends USR2 (train then saves its step and requeues)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind != "slurm":
            raise ConfigError(f"launcher.kind={self.kind!r}: the slurm launcher config takes 'slurm'")
        if self.max_num_timeout < 0 or self.signal_delay_s < 1:
            raise ConfigError(
                f"launcher.max_num_timeout={self.max_num_timeout} must be >= 0 and "
                f"launcher.signal_delay_s={self.signal_delay_s} >= 1"
            )
