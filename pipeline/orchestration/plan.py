"""The plan as a value: for a config and a run, what every stage will do — computed once, read by everyone.

The runner executes it, ``dry_run=true`` prints it, the launchers submit from it. Each planned stage carries
its launch id (the attempt its markers and record will carry), its task count and resources, its dependencies
with after-ok / after-any semantics, and whether it is skipped and why. Combinations that cannot work on this
machine are refused here, before anything is created.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass

from pipeline.config.schema import STAGE_ALL, PipelineConfig
from pipeline.errors import ConfigError, RunNotFoundError
from pipeline.orchestration.contract import Resources, StageContract
from pipeline.stages import INSIDE, ORDER, get_stage
from pipeline.storage.layout import RunLayout
from pipeline.strategies.devices import check_backend


@dataclass(frozen=True)
class PlannedStage:
    name: str
    contract: StageContract
    launch_id: str
    """Attempt id decided here, by the launching process; the job's record and markers carry it."""
    tasks: int
    resources: Resources
    needs: tuple[str, ...]
    """Stages of this plan that run before it and whose outputs it reads (its job dependencies)."""
    skip: str | None
    """Why it will not run (its outputs verify), or None: it runs."""

    @property
    def runs(self) -> bool:
        return self.skip is None

    @property
    def dependency(self) -> str:
        """SLURM-style dependency kind on ``needs``: ``afterany`` runs even after an upstream failure."""
        return "afterany" if self.contract.after_any else "afterok"

    def describe(self) -> str:
        if not self.runs:
            return f"skip {self.name}: {self.skip}"
        r = self.resources
        gpus = f" gpus/task={r.gpus_per_task}" if r.gpus_per_task else ""
        deps = f"{self.dependency}:{','.join(self.needs)}" if self.needs else "-"
        return (
            f"run  {self.name} ({self.tasks} task{'s' if self.tasks != 1 else ''}; cpus/task={r.cpus_per_task} "
            f"mem/task={r.mem_gb:g}GB time={r.timeout_min}min{gpus}; after {deps})"
        )


@dataclass(frozen=True)
class Plan:
    cfg: PipelineConfig
    layout: RunLayout
    stages: tuple[PlannedStage, ...]

    def describe(self) -> list[str]:
        return [s.describe() for s in self.stages]

    def dependents_after_any(self, name: str) -> list[PlannedStage]:
        """Running stages that must still run after ``name`` failed or was interrupted (the committer)."""
        return [s for s in self.stages if s.runs and name in s.needs and s.contract.after_any]


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
    return [cfg.stage]


def make_plan(cfg: PipelineConfig, layout: RunLayout) -> Plan:
    """Decide every stage (reads the run dir, writes nothing) and refuse what cannot work here."""
    running: list[str] = []
    planned: list[PlannedStage] = []
    exists = layout.run_dir.is_dir()
    for name in selected_stages(cfg):
        module = get_stage(name)
        contract = module.CONTRACT
        upstream = tuple(n for n in contract.needs if n in running)
        skip: str | None = None
        if not (cfg.force or upstream or (contract.creates_run and cfg.run.overwrite)):
            skip = module.is_done(cfg, layout) if exists else None
        if skip is None:
            running.append(name)
        planned.append(
            PlannedStage(
                name=name,
                contract=contract,
                launch_id=f"{name}-{uuid.uuid4().hex[:10]}",
                tasks=contract.num_tasks(cfg),
                resources=contract.resources_for(cfg),
                needs=upstream,
                skip=skip,
            )
        )
    plan = Plan(cfg=cfg, layout=layout, stages=tuple(planned))
    check_machine(plan)
    return plan


def check_machine(plan: Plan) -> None:
    """Refuse launcher/backend combinations that cannot work on this machine (exit 2, nothing created)."""
    cfg = plan.cfg
    kind = cfg.launcher.kind
    to_run = [s for s in plan.stages if s.runs]
    if kind == "slurm" and shutil.which("sbatch") is None:
        raise ConfigError("launcher=slurm but sbatch is not on PATH: run on a SLURM login node, or use launcher=local")
    if kind == "inprocess":
        multi = [f"{s.name} ({s.tasks} task(s) in a process group)" for s in to_run if s.contract.distributed]
        if multi:
            raise ConfigError(
                f"launcher=inprocess runs single-task stages in this process and cannot run {', '.join(multi)}: "
                "use launcher=local, or stage=<single-task stage>"
            )
    if kind != "slurm" and any(s.resources.gpus_per_task for s in to_run):  # a login node may have no GPU
        check_backend(cfg.strategy)
