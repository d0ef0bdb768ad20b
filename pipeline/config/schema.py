"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore; values live in ``conf/``.

Everything below the entry point sees these objects, never a ``DictConfig``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from omegaconf import MISSING

from pipeline.checkpoint import options
from pipeline.config.fields import MUTABLE, PER_LAUNCH
from pipeline.config.launcher import LauncherConfig, LocalLauncherConfig, SlurmLauncherConfig
from pipeline.config.workload import DataConfig, ModelConfig, TrainConfig
from pipeline.errors import ConfigError
from pipeline.storage.sizes import parse_size
from pipeline.storage.writers import auto_writer_threads

STAGE_ALL = "all"


@dataclass
class RunConfig:
    id: str | None = field(default=None, metadata=PER_LAUNCH)
    """Run to continue (``last`` = the newest run). Empty: a new run, id = UTC time + random suffix."""
    create: bool = field(default=False, metadata=PER_LAUNCH)
    """With ``run.id``: create that run if it does not exist (otherwise an unknown id is an error)."""
    root: str = field(default="outputs", metadata=PER_LAUNCH)
    """Directory under which runs live: ``<root>/<experiment>/<id>/``."""
    overwrite: bool = field(default=False, metadata=PER_LAUNCH)
    """Delete the run's outputs and start it over (done only by prepare-dirs, before any rank starts)."""

    def __post_init__(self) -> None:
        if self.id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", self.id):
            raise ConfigError(f"run.id={self.id!r} is not a valid run id: use letters, digits, '_', '-', '.'")
        if not self.root:
            raise ConfigError("run.root is empty: give the directory that holds the runs (default: outputs)")


@dataclass
class StrategyConfig:
    name: str = MISSING
    """Parallelism: ``ddp`` (replicated params), ``fsdp2`` (``fully_shard`` per decoder layer + root) or
    ``deepspeed`` (ZeRO stage ``zero_stage``). The whole section may change between launches of a run: it
    resumes through a world-size-free form (see docs/deepspeed-and-import.md, "Resume anywhere")."""
    world_size: int = 2
    """Number of training ranks (tasks of the train job)."""
    backend: str = "gloo"
    """torch.distributed backend: ``gloo`` on CPU, ``nccl`` on GPU."""
    pg_timeout_s: float = 120.0
    """Deadline for process-group init and every collective."""
    zero_stage: int = 2
    """DeepSpeed only: ZeRO stage 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters) partitioned."""
    precision: str = "fp32"
    """``fp32``, or ``bf16`` mixed precision with fp32 master weights (the checkpoint holds fp32): DDP autocasts,
    FSDP2 casts parameters by its ``MixedPrecisionPolicy`` (fp32 gradient reduction), DeepSpeed its bf16 mode."""
    offload: str = "none"
    """DeepSpeed only: ``none``, ``cpu`` (optimizer state; ZeRO-3 also parameters) or ``nvme`` (needs libaio and
    ``nvme_path``; the async_io op is compiled on first use)."""
    nvme_path: str | None = None
    """DeepSpeed ``offload=nvme``: a node-local directory; each rank swaps under its own subdirectory."""
    shm_comm: bool = False
    """DeepSpeed on CPU: build and use DeepSpeed's shared-memory allreduce op (a one-time ~25 s compile); off,
    gloo carries every collective."""

    def __post_init__(self) -> None:
        if self.name not in ("ddp", "fsdp2", "deepspeed"):
            raise ConfigError(
                f"strategy.name={self.name!r} is not supported: "
                "choose strategy=ddp, strategy=fsdp2 or strategy=deepspeed"
            )
        options.check_world_size(self.world_size, "strategy.world_size")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"strategy.backend={self.backend!r}: use gloo (CPU) or nccl (GPU)")
        if not self.pg_timeout_s > 0:
            raise ConfigError(f"strategy.pg_timeout_s={self.pg_timeout_s} must be > 0")
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"strategy.zero_stage={self.zero_stage}: DeepSpeed ZeRO stages are 1, 2 and 3")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"strategy.precision={self.precision!r}: use fp32 or bf16")
        if self.offload not in ("none", "cpu", "nvme"):
            raise ConfigError(f"strategy.offload={self.offload!r}: use none, cpu or nvme")
        if self.name != "deepspeed" and self.offload != "none":
            raise ConfigError(
                f"strategy.offload={self.offload} needs strategy=deepspeed (strategy={self.name} has no offload)"
            )
        if self.offload == "nvme" and not self.nvme_path:
            raise ConfigError("strategy.offload=nvme needs strategy.nvme_path=<node-local directory>")


KEYWORD_SECTIONS: Final = {"import": "import_"}
"""Command-line section names that are Python keywords -> their schema field."""


OPEN_DICTS: Final = ("model.config", "model.args", "train.step.args", "train.loop.args")
"""Free-form dict fields: ``model.config={...}`` and ``model.config.n_layer=4`` set or add keys there."""


def schema_key(override: str) -> str:
    """``import.source=x`` -> ``import_.source=x`` (also with ``+``/``++``/``~`` prefixes); a key in an open
    dict (:data:`OPEN_DICTS`) is forced (``++``: Hydra's struct mode would refuse its new keys); others unchanged."""
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    rest = override[len(prefix) :]
    for word, field_name in KEYWORD_SECTIONS.items():
        if rest.startswith(word + "."):
            return prefix + field_name + rest[len(word) :]
    key = rest.split("=", 1)[0]
    if "=" in rest and prefix in ("", "+") and any(key == d or key.startswith(d + ".") for d in OPEN_DICTS):
        return "++" + rest
    return override


def rank_batch_size(train: TrainConfig, world_size: int) -> int:
    """Samples each rank trains on per step (``train.global_batch_size`` split evenly, else the micro batch)."""
    if train.global_batch_size is None:
        return train.micro_batch_size
    if train.global_batch_size % world_size:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} does not split evenly over "
            f"strategy.world_size={world_size} ranks: choose a multiple of the world size"
        )
    return train.global_batch_size // world_size


@dataclass
class FastCheckpointConfig:
    """The fast tier: each rank's state kept node-local and on peer nodes, for recovery in seconds
    (docs/fast-recovery.md). Not part of the run's identity: it may be turned on, off or changed at any launch."""

    every: int | None = None
    """Keep a fast copy every this many steps (null: no fast tier). Cheap: training waits only for the copy of
    its tensors to CPU; a thread writes and replicates it."""
    dir: str = "/dev/shm/pipeline-fast"
    """Node-local dir (RAM-backed by default): a dir per run is made inside. Must not be shared between nodes."""
    replicas: int = 1
    """Copies of each rank's shard on other nodes (0: own copy only, which does not survive its node)."""
    keep: int = 2
    """Steps kept per copy: the newest complete one survives while the next is written."""

    def __post_init__(self) -> None:
        if self.every is not None:
            options.check_every_steps(self.every, "checkpoint.fast.every")
        options.check_keep(self.keep, "checkpoint.fast.keep")
        if type(self.replicas) is not int or self.replicas < 0:
            raise ConfigError(f"checkpoint.fast.replicas={self.replicas!r}: must be 0 or a positive integer")
        if not self.dir:
            raise ConfigError("checkpoint.fast.dir is empty: give a node-local dir (default /dev/shm/pipeline-fast)")


@dataclass
class CheckpointConfig:
    every: int = 4
    """Save a checkpoint every this many steps (and always at the last step)."""
    storage: str | None = None
    """Where checkpoints live: null = the run dir's ``checkpoints/``; ``s3://<bucket>[/<prefix>]`` = an
    S3-compatible bucket, under ``<prefix>/<experiment>/<run_id>/`` (endpoint, region and credentials from the
    standard AWS environment variables and config files: never from the config). Part of the run's identity."""
    marker_deadline_s: float = field(default=300.0, metadata=MUTABLE)
    """How long verify-manifest waits for every rank's done-marker while the train job is still running."""
    fail_on_save_error: bool = field(default=False, metadata=MUTABLE)
    """If a shard save fails: false = log loudly and keep training (the step is never committed); true = stop."""
    writer_threads: int | None = field(default=None, metadata=MUTABLE)
    """Files each rank writes in parallel per DCP save (each fsync'd once); 1 = one file per rank; null = the
    CPUs this rank has to itself (``SLURM_CPUS_PER_TASK``, else this machine's CPUs over the world size), at
    most 4. More help on disks that reward parallel streams (NVMe, parallel filesystems) when cores are free."""
    dedup: bool = field(default=True, metadata=MUTABLE)
    """Incremental saves (DDP/FSDP2): parameters that do not train (a LoRA run's base weights, frozen layers) and
    buffers are saved as pieces of their own, and a piece whose bytes equal the latest committed step's is not
    written again (a hard link; in a bucket, one object every step's manifest lists). Every step stays complete
    and loads alone; false = every save writes every byte."""
    async_save: bool = field(default=False, metadata=MUTABLE)
    """Save in the background (DDP/FSDP2): training waits only while the state is copied into a staging buffer
    reused by every save (pinned CPU memory for GPU state); a daemon thread writes it, and the step's marker
    only once its files are fsync'd. The next save first waits for the previous one (and so does the end of
    training); a writer that dies or passes ``async_deadline_s`` fails that step like a failed shard save."""
    async_deadline_s: float = field(default=600.0, metadata=MUTABLE)
    """With ``async_save``: the longest any wait on the background writer may take (and the timeout of the
    writer's own process group); past it the writer is given up on and named with what it was doing."""

    def writer_threads_for(self, world_size: int) -> int:
        """``writer_threads``, or the automatic choice for a rank of a ``world_size``-rank job on this machine."""
        if self.writer_threads is not None:
            return self.writer_threads
        return auto_writer_threads(world_size)

    keep_last: int | None = field(default=None, metadata=MUTABLE)
    """Retention: keep the newest this many committed steps up to ``latest`` (null = keep every step). Older
    steps are deleted by verify-manifest after each commit; ``latest`` and steps newer than it are always kept."""
    keep_every: int | None = field(default=None, metadata=MUTABLE)
    """Retention: also keep, forever, every committed step that is a multiple of this (null = no such steps).
    With ``keep_last`` null too, nothing is ever deleted."""
    keep_best: int | None = field(default=None, metadata=MUTABLE)
    """Retention: also keep the this many committed steps (up to ``latest``) whose ``best_metric`` is best, as
    train recorded it in each step's manifest (null = no such rule). A step that recorded no such metric is kept."""
    best_metric: str = field(default="loss", metadata=MUTABLE)
    """The metric ``keep_best`` ranks by: train records ``loss`` (the mean loss, over every rank, of the steps it
    trained since the last save, or since it resumed) and ``eval_loss`` (when eval ran at the step)."""
    best_mode: str = field(default="min", metadata=MUTABLE)
    """``min``: the lowest ``best_metric`` is best (a loss); ``max``: the highest (an accuracy)."""
    keep_outputs_last: int | None = field(default=None, metadata=MUTABLE)
    """Retention of ``consolidated/`` and ``export/``: keep the complete outputs of the newest this many steps up
    to ``latest`` (null = keep all); latest's output is always kept, and an older one goes only once a newer
    complete output of the same kind exists."""

    fast: FastCheckpointConfig = field(default_factory=FastCheckpointConfig, metadata=MUTABLE)
    """The fast tier (``checkpoint.fast.every``, ``.dir``, ``.replicas``, ``.keep``)."""

    def __post_init__(self) -> None:  # the knobs the library shares are checked by its validators, named as here
        options.check_every_steps(self.every, "checkpoint.every")
        options.check_storage(self.storage, "checkpoint.storage")
        options.check_deadline(self.marker_deadline_s, "checkpoint.marker_deadline_s")
        options.check_writer_threads(self.writer_threads, "checkpoint.writer_threads")
        options.check_deadline(self.async_deadline_s, "checkpoint.async_deadline_s")
        for key in ("keep_last", "keep_every", "keep_outputs_last"):
            options.check_keep(getattr(self, key), f"checkpoint.{key}")
        names = ("checkpoint.keep_best", "checkpoint.best_metric", "checkpoint.best_mode")
        options.check_best(self.keep_best, self.best_metric, self.best_mode, names)


@dataclass
class ExportConfig:
    format: str = "hf"
    """``hf``: a Hugging Face layout of the run's model (a user module: safetensors + its factory in
    ``config.json``); ``none``: no export stage (the consolidated file is the output). Choose with ``export=none``."""
    adapter: bool = False
    """LoRA runs: also write the adapter alone (``adapter/``: ``adapter_model.safetensors`` + ``adapter_config.json``,
    as ``peft`` saves it) beside the merged model."""
    max_shard_size: str = "5GB"
    """Largest safetensors shard of the export (``KB``/``MB``/``GB``, powers of 1000 as in transformers); 5GB is the
    size Hugging Face models are commonly sharded at (a 1B-parameter fp32 model: 1 shard). ``+experiment=tiny``
    sets 200KB, so its 2-layer model is exported in several shards."""
    dtype: str = "float32"
    """dtype of exported weights: float32, bfloat16 or float16."""

    def __post_init__(self) -> None:
        parse_size(self.max_shard_size)
        if self.format not in ("hf", "none"):
            raise ConfigError(f"export.format={self.format!r}: choose export=hf or export=none")
        options.check_export_dtype(self.dtype, "export.dtype")


@dataclass
class ImportConfig:
    """A checkpoint the pipeline did not write, committed, consolidated and exported like a trained step.

    On the command line this section is ``import.*`` (``import`` is a Python keyword, so the schema field is
    ``import_``)."""

    source: str | None = None
    """A DCP directory, a DeepSpeed checkpoint directory or a ``torch.save`` file (or ``s3://bucket/prefix``
    holding one: downloaded first); set, the run imports it instead of training."""
    allow_pickle: bool = field(default=False, metadata=MUTABLE)
    """Read files that need full unpickling (arbitrary code on load): only for a source you trust."""
    step: int | None = None
    """Step number of the imported checkpoint (null: the step it records, else 1)."""

    def __post_init__(self) -> None:
        if self.source and not self.source.startswith("s3://"):  # fixed where the run is launched (a relative path)
            self.source = str(Path(self.source).expanduser().resolve())
        if self.step is not None and self.step < 1:
            raise ConfigError(f"import.step={self.step} must be >= 1 (or null: the step the checkpoint records)")


@dataclass
class PipelineConfig:
    experiment: str = MISSING
    """Name of the experiment (set by ``+experiment=<name>``)."""
    stage: str = field(default=STAGE_ALL, metadata=PER_LAUNCH)
    """``all`` runs the DAG; a stage name (e.g. ``consolidate``) reruns that one stage of ``run.id``."""
    force: bool = field(default=False, metadata=PER_LAUNCH)
    """Redo a stage even if its outputs verify."""
    dry_run: bool = field(default=False, metadata=PER_LAUNCH)
    """Print the resolved config and the stage plan, then stop."""
    status: bool = field(default=False, metadata=PER_LAUNCH)
    """Print the run's state (plan, stage records, lease owner, latest), then stop; needs ``run.id``."""
    run: RunConfig = field(default_factory=RunConfig)
    """Which run this is and where it lives."""
    launcher: LauncherConfig = field(default=MISSING, metadata=MUTABLE)
    """How stage jobs are launched: choose with ``launcher=local``, ``inprocess`` or ``slurm``."""
    strategy: StrategyConfig = field(default=MISSING, metadata=MUTABLE)
    """Parallelism of train: ddp, fsdp2 or deepspeed; may change between launches (see run.yaml).

    Another world size or strategy continues the run through a world-size-free form of its newest step."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model: a ``transformers`` config, pretrained weights, your factory, or the built-in Llama."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and tokenizer, prepared by prepare-dirs (token files are read in place)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Length, optimizer and schedule of training."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are saved, how long verify-manifest waits for them, and how many it keeps."""
    export: ExportConfig = field(default_factory=ExportConfig, metadata=MUTABLE)
    """Hugging Face export of the consolidated checkpoint."""
    import_: ImportConfig = field(default_factory=ImportConfig)
    """``import.*`` on the command line: import a checkpoint instead of training (see ImportConfig)."""

    def __post_init__(self) -> None:
        strategy = self.strategy if isinstance(self.strategy, StrategyConfig) else None
        if strategy is not None and strategy.name == "deepspeed" and self.checkpoint.async_save:
            raise ConfigError(
                "checkpoint.async_save=true works with strategy=ddp or strategy=fsdp2, not strategy=deepspeed "
                "(DeepSpeed saves through its own engine): set checkpoint.async_save=false"
            )


_REGISTERED: list[Any] = []


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore, once per store (each registration builds every structured
    config: about 0.1 s, and the key docs ask for it once per config group). Hydra is imported here, not with the
    schema: a stage's task unpickles its config without it (half a second of CPU per task process)."""
    from hydra.core.config_store import ConfigStore  # noqa: PLC0415

    cs = ConfigStore.instance()
    if any(done is cs for done in _REGISTERED):
        return
    cs.store(name="base_config", node=PipelineConfig)
    cs.store(group="launcher", name="base_local", node=LocalLauncherConfig)
    cs.store(group="launcher", name="base_slurm", node=SlurmLauncherConfig)
    cs.store(group="strategy", name="base_strategy", node=StrategyConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="train", name="base_train", node=TrainConfig)
    cs.store(group="checkpoint", name="base_checkpoint", node=CheckpointConfig)
    cs.store(group="export", name="base_export", node=ExportConfig)
    _REGISTERED.append(cs)
