"""The one function that maps a stage's declared resources to submitit parameters."""

from __future__ import annotations

import math
from typing import Any

from pipeline.config.schema import LauncherConfig, SlurmLauncherConfig
from pipeline.orchestration.contract import StageContract


def submitit_parameters(
    contract: StageContract, num_tasks: int, launcher: LauncherConfig, run_id: str
) -> dict[str, Any]:
    """Generic submitit (``AutoExecutor``) parameters, plus ``slurm_*`` ones for the SLURM launcher."""
    res = contract.resources
    params: dict[str, Any] = {
        "name": f"{contract.job_name}-{run_id}",
        "nodes": 1,
        "tasks_per_node": num_tasks,
        "cpus_per_task": res.cpus_per_task,
        "timeout_min": max(1, math.ceil(min(res.timeout_min, launcher.job_deadline_s / 60))),
    }
    if isinstance(launcher, SlurmLauncherConfig):
        params["mem_gb"] = res.mem_gb * num_tasks
        if launcher.partition:
            params["slurm_partition"] = launcher.partition
        if launcher.account:
            params["slurm_account"] = launcher.account
    return params
