"""The plan as a value: for a config and a run, what every stage will do — computed once, read by everyone.

The runner executes it, ``dry_run=true`` prints it, the launchers submit from it. Each planned stage carries
its launch id (the attempt its markers and record will carry), its task count and resources, its dependencies
with after-ok / after-any semantics, and whether it is skipped and why. Combinations that cannot work on this
machine are refused here, before anything is created.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass, replace
from typing import TypeVar, cast

import pipeline.stagekit.checkpoint_store as storage
from pipeline.config.launcher import SlurmLauncherConfig
from pipeline.config.schema import STAGE_ALL, PipelineConfig, rank_batch_size
from pipeline.errors import ConfigError, PipelineError, RunNotFoundError, plural
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import Resources, StageContract
from pipeline.stages import INSIDE, ORDER, get_stage
from pipeline.storage.integrity import mtimes_ns
from pipeline.strategies.devices import check_backend
from pipeline.workload.size import check_freeze

T = TypeVar("T")


@dataclass(frozen=True)
class PlannedStage:
    name: str
    contract: StageContract
    launch_id: str
    """Attempt id decided here, by the launching process; the job's record and markers carry it."""
    tasks: int
    resources: Resources
    needs: tuple[str, ...]
    """Stages of this plan that run before it and whose outputs it reads, and the stages those follow through a
    stage that runs after any outcome (:func:`followed`): its job dependencies."""
    skip: str | None
    """Why it will not run (its outputs verify), or None: it runs."""

    @property
    def runs(self) -> bool:
        return self.skip is None

    @property
    def dependency(self) -> str:
        """SLURM-style dependency kind on ``needs``: ``afterany`` runs even after an upstream failure."""
        return "afterany" if self.contract.after_any else "afterok"

    def dependency_on(self, need: str) -> str:
        """SLURM dependency kind on one stage it needs: ``after`` (starts once it has started) beside it."""
        return "after" if self.contract.beside == need else self.dependency

    def dependencies(self) -> str:
        return ",".join(f"{self.dependency_on(n)}:{n}" for n in self.needs) or "-"

    def describe(self) -> str:
        if not self.runs:
            return f"skip {self.name}: {self.skip}"
        r = self.resources
        gpus = f" gpus/task={r.gpus_per_task}" if r.gpus_per_task else ""
        gpus += f" nodes={r.nodes}" if r.nodes > 1 else ""
        deps = self.dependencies()
        return (
            f"run  {self.name} ({plural(self.tasks, 'task')}; cpus/task={r.cpus_per_task} "
            f"mem/task={r.mem_gb:g}GB time={r.timeout_min}min{gpus}; after {deps})"
        )


@dataclass(frozen=True)
class Plan:
    cfg: PipelineConfig
    layout: RunLayout
    stages: tuple[PlannedStage, ...]
    state: tuple[int, ...] = ()
    """:func:`run_state` when the skips were decided: the plan still holds while it is unchanged."""

    def still_holds(self) -> bool:
        """Nothing the skips were read from changed since (a launch's checks, then its lease: planned once)."""
        return bool(self.state) and self.state == run_state(self.layout)

    def describe(self) -> list[str]:
        return [s.describe() for s in self.stages]


def selected_stages(cfg: PipelineConfig) -> list[str]:
    if cfg.stage == STAGE_ALL:
        if cfg.force:
            raise ConfigError("force=true redoes one stage: add stage=<name> (one of " + ", ".join(ORDER) + ")")
        return list(ORDER)
    if cfg.stage in INSIDE:
        host = next(n for n in ORDER if get_stage(n).CONTRACT.distributed)
        raise ConfigError(f"{cfg.stage} runs inside {host} on every rank: rerun stage={host} instead")
    if cfg.stage not in ORDER:
        raise RunNotFoundError(f"unknown stage {cfg.stage!r}: choose one of {', '.join(ORDER)} or all")
    # A stage that runs beside the selected one (the committer beside train) is launched with it.
    return [n for n in ORDER if n == cfg.stage or get_stage(n).CONTRACT.beside == cfg.stage]


def resolve_resources(contract: StageContract, cfg: PipelineConfig) -> Resources:
    """The stage contract's resources, with ``launcher.*`` defaults and ``launcher.stages.<stage>`` overrides."""
    base = contract.resources_for(cfg)
    over = getattr(cfg.launcher.stages, contract.name, None)  # one typed field per stage: a lookup by name
    launcher = cfg.launcher
    slurm = launcher if isinstance(launcher, SlurmLauncherConfig) else None
    extra = {**(slurm.extra if slurm else {}), **(dict(over.extra) if over is not None else {})}

    def pick(key: str, default: T) -> T:
        value = getattr(over, key, None) if over is not None else None
        return default if value is None else cast(T, value)

    res = replace(
        base,
        timeout_min=pick("time_min", base.timeout_min),
        cpus_per_task=pick("cpus_per_task", base.cpus_per_task),
        mem_gb=pick("mem_gb", base.mem_gb),
        gpus_per_task=pick("gpus_per_task", base.gpus_per_task),
        nodes=pick("nodes", base.nodes),
        gres=pick("gres", base.gres),
        partition=pick("partition", slurm.partition if slurm else None),
        qos=pick("qos", slurm.qos if slurm else None),
        account=pick("account", slurm.account if slurm else None),
        constraint=pick("constraint", slurm.constraint if slurm else None),
        extra=tuple(sorted((str(k), str(v)) for k, v in extra.items())),
    )
    tasks = contract.num_tasks(cfg)
    if res.nodes > 1 and (not contract.distributed or tasks % res.nodes):
        raise ConfigError(
            f"launcher.stages.{contract.name}.nodes={res.nodes}: "
            + (
                f"{contract.name} is one task; only train spans nodes"
                if not contract.distributed
                else f"strategy.world_size={tasks} tasks do not spread evenly over {res.nodes} nodes"
            )
        )
    return res


def _not_applicable(module: object, cfg: PipelineConfig) -> str | None:
    """Why a stage has no part in this run at all (train in an import run, import in a training run)."""
    check = getattr(module, "not_applicable", None)
    return check(cfg) if callable(check) else None


def followed(contract: StageContract) -> tuple[str, ...]:
    """The stages whose success a stage waits for, in plan order: its ``needs`` and, past a need that runs after
    any outcome (the committer beside train), that need's own, since the success of such a stage says nothing of
    theirs. So a stage without ``after_any`` is skipped when train (or the import) failed, although the committer
    beside it ended well: consolidate never starts on a run whose train committed nothing."""
    names = set(contract.needs)
    for need in contract.needs:
        upstream = get_stage(need).CONTRACT
        if upstream.after_any:
            names.update(followed(upstream))
    return tuple(n for n in ORDER if n in names)


def run_state(layout: RunLayout) -> tuple[int, ...]:
    """A stamp of what stages' ``is_done`` read: the run's managed areas' mtimes (every job, commit, output and
    record changes one of them by a rename or an unlink)."""
    areas = [layout.stages, layout.checkpoints, layout.staging, layout.consolidated, layout.export]  # not the run
    # dir itself: the launch's own lease and logs land there before it looks again
    return mtimes_ns([*areas, layout.latest, layout.run_yaml, layout.assets])


def make_plan(cfg: PipelineConfig, layout: RunLayout) -> Plan:
    """Decide every stage (reads the run dir, writes nothing) and refuse what cannot work here."""
    state = run_state(layout)
    running: list[str] = []
    planned: list[PlannedStage] = []
    exists = layout.run_dir.is_dir()
    for name in selected_stages(cfg):
        module = get_stage(name)
        contract = module.CONTRACT
        upstream = tuple(n for n in followed(contract) if n in running)
        skip: str | None = _not_applicable(module, cfg)
        if skip is None and not (cfg.force or upstream or (contract.creates_run and cfg.run.overwrite)):
            skip = module.is_done(cfg, layout) if exists else None
        if skip is None:
            running.append(name)
        planned.append(
            PlannedStage(
                name=name,
                contract=contract,
                launch_id=f"{name}-{uuid.uuid4().hex[:10]}",
                tasks=contract.num_tasks(cfg),
                resources=resolve_resources(contract, cfg),
                needs=upstream,
                skip=skip,
            )
        )
    plan = Plan(cfg=cfg, layout=layout, stages=tuple(planned), state=state)
    check_machine(plan)
    return plan


def check_machine(plan: Plan) -> None:
    """Refuse launcher/backend combinations that cannot work on this machine (exit 2, nothing created)."""
    cfg = plan.cfg
    kind = cfg.launcher.kind
    to_run = [s for s in plan.stages if s.runs]
    if kind == "slurm" and shutil.which("sbatch") is None and not cfg.dry_run:
        raise ConfigError("launcher=slurm but sbatch is not on PATH: run on a SLURM login node, or use launcher=local")
    if isinstance(cfg.launcher, SlurmLauncherConfig) and cfg.run.overwrite and not cfg.launcher.wait:
        raise ConfigError(
            "run.overwrite=true on SLURM needs launcher.wait=true (the launch records the run again once "
            "prepare_dirs has started it over)"
        )
    if kind != "slurm" and any(s.resources.nodes > 1 for s in to_run):
        raise ConfigError("launcher.stages.train.nodes > 1 needs launcher=slurm: a local launch is one machine")
    if kind == "inprocess":
        multi = [f"{s.name} ({plural(s.tasks, 'task')} in a process group)" for s in to_run if s.contract.distributed]
        if multi:
            raise ConfigError(
                f"launcher=inprocess runs single-task stages in this process and cannot run {', '.join(multi)}: "
                "use launcher=local, or stage=<single-task stage>"
            )
    if kind != "slurm" and any(s.resources.gpus_per_task for s in to_run):  # a login node may have no GPU
        check_backend(cfg.strategy)
    if any(s.contract.distributed for s in to_run):
        rank_batch_size(cfg.train, cfg.strategy.world_size)
    if cfg.model.freeze and any(s.name == "train" for s in to_run):
        check_freeze(cfg)
    if to_run:
        try:  # a bucket answers and enforces the conditional writes every commit relies on
            storage.store(cfg, plan.layout).check()
        except PipelineError as e:
            raise ConfigError(f"checkpoint.storage: {e}") from None
    for s in to_run:
        if s.contract.check_before_launch:  # e.g. an import source that cannot be read is refused up front
            get_stage(s.name).check_inputs(cfg, plan.layout)
