"""The one function that maps a stage's resources to submitit parameters."""

from __future__ import annotations

from typing import Any

from pipeline.config.schema import LauncherConfig, SlurmLauncherConfig
from pipeline.orchestration.contract import Resources, StageContract


def submitit_parameters(
    contract: StageContract, num_tasks: int, res: Resources, launcher: LauncherConfig, run_id: str
) -> dict[str, Any]:
    """Generic submitit (``AutoExecutor``) parameters, plus ``slurm_*`` ones for the SLURM launcher.

    GPUs are asked for per node (``gpus_per_node``): without them submitit's local executor starts every job
    with ``CUDA_VISIBLE_DEVICES=''``; with them it shows devices ``0..N-1``. Every task sees all of the node's
    GPUs and ``LOCAL_RANK`` picks one (so not ``gpus_per_task``, which SLURM would bind one per task).
    """
    params: dict[str, Any] = {
        "name": f"{contract.job_name}-{run_id}",
        "nodes": 1,
        "tasks_per_node": num_tasks,
        "cpus_per_task": res.cpus_per_task,
        "timeout_min": max(1, res.timeout_min),
    }
    gpus = res.gpus_per_task * num_tasks
    if gpus:
        params["gpus_per_node"] = gpus
    if isinstance(launcher, SlurmLauncherConfig):
        params["mem_gb"] = res.mem_gb * num_tasks
        if launcher.partition:
            params["slurm_partition"] = launcher.partition
        if launcher.account:
            params["slurm_account"] = launcher.account
    return params
