"""Where and how a stage's job runs: submitit parameters, the rendezvous port, the variables a task drops."""

from __future__ import annotations

import os
import shutil
import socket
import time
import zlib
from pathlib import Path
from typing import Any

from pipeline.config.launcher import LauncherConfig, SlurmLauncherConfig
from pipeline.driver.plan import Plan, PlannedStage
from pipeline.errors import StageFailedError
from pipeline.stagekit.contract import Resources, StageContract

# What a surrounding launcher (torchrun, a SLURM allocation, a user's shell) may have left in the environment. Any
# of the first six makes TorchDistributedEnvironment.export() refuse ("... is already set"); an inherited
# MASTER_PORT would also become the job's port; TORCHELASTIC_USE_AGENT_STORE=True would make rank 0 a client of a
# store nobody hosts. A job's rendezvous is its own, so every task drops them all.
INHERITED_RENDEZVOUS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def submitit_parameters(
    contract: StageContract,
    num_tasks: int,
    res: Resources,
    launcher: LauncherConfig,
    run_id: str,
    dependency: str = "",
) -> dict[str, Any]:
    """Generic submitit (``AutoExecutor``) parameters, plus ``slurm_*`` ones for the SLURM launcher.

    GPUs are asked for per node (``gpus_per_node``): without them submitit's local executor starts every job
    with ``CUDA_VISIBLE_DEVICES=''``; with them it shows devices ``0..N-1``. Every task sees all of the node's
    GPUs and ``LOCAL_RANK`` picks one (so not ``gpus_per_task``, which SLURM would bind one per task). A job on
    several nodes runs ``num_tasks / nodes`` tasks on each. ``dependency`` is SLURM's ``--dependency`` value
    (e.g. ``afterok:12,after:13``); a job whose dependency can never be satisfied is cancelled by SLURM
    (``--kill-on-invalid-dep=yes``) instead of pending forever.
    """
    per_node = num_tasks // res.nodes
    params: dict[str, Any] = {
        "name": f"{contract.job_name}-{run_id}",
        "nodes": res.nodes,
        "tasks_per_node": per_node,
        "cpus_per_task": res.cpus_per_task,
        "timeout_min": max(1, res.timeout_min),
    }
    gpus = res.gpus_per_task * per_node
    if gpus and not res.gres:
        params["gpus_per_node"] = gpus
    if isinstance(launcher, SlurmLauncherConfig):
        params["mem_gb"] = res.mem_gb * per_node
        params["slurm_signal_delay_s"] = launcher.signal_delay_s
        for key in ("partition", "qos", "account", "constraint", "gres"):
            value = getattr(res, key)
            if value:
                params[f"slurm_{key}"] = value
        if dependency:
            params["slurm_dependency"] = dependency
        extra: dict[str, Any] = {"kill-on-invalid-dep": "yes"} if dependency else {}
        extra.update(dict(res.extra))
        if extra:
            params["slurm_additional_parameters"] = extra
    return params


def sbatch_lines(planned: PlannedStage, plan: Plan) -> list[str]:
    """The ``#SBATCH`` lines submitit would write for ``planned`` (dependencies by stage name: no job ids yet)."""
    import submitit  # noqa: PLC0415 - only for dry runs on SLURM

    if shutil.which("srun") is None:  # submitit refuses to write a SLURM script without it (a raw RuntimeError)
        return ["(no #SBATCH lines: submitit writes them only where srun is on PATH; dry-run on a SLURM login node)"]
    dependency = ",".join(f"{planned.dependency_on(n)}:<{n} job>" for n in planned.needs)
    params = submitit_parameters(
        planned.contract, planned.tasks, planned.resources, plan.cfg.launcher, plan.layout.run_id, dependency
    )
    executor = submitit.AutoExecutor(folder=plan.layout.logs / planned.name / "%j", cluster="slurm")
    executor.update_parameters(**params)
    slurm: Any = executor._executor  # noqa: SLF001 - submitit's own script text, exactly as sbatch gets it
    text = slurm._make_submission_file_text("<task>", "<uid>")  # noqa: SLF001
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def rendezvous_port(job_id: str) -> int:
    """The job's rendezvous port: a function of its id (every task, on every node, agrees), below the kernel's
    ephemeral range. submitit's own choice (20000-60000) overlaps that range, where srun's and slurmstepd's
    listening sockets live: a collision fails rank 0 with EADDRINUSE (seen on the test cluster)."""
    low, high = 10000, _EPHEMERAL_START
    return low + zlib.crc32(job_id.encode()) % (high - low)


def _ephemeral_start() -> int:
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return start if start > 12000 else 32768


_EPHEMERAL_START = _ephemeral_start()

LOCAL_PORT_ENV = "PIPELINE_RENDEZVOUS_PORT"
"""Set by the local launcher in a distributed job's setup shell: the port its tasks rendezvous on."""


def free_local_port(tries: int = 256, start: int | None = None) -> int:
    """A rendezvous port for a local job, chosen once by the launcher: free on this machine now and below the
    ephemeral range. A port derived from the job id alone can be a running service's (SeaweedFS's master listens
    on 19333) or another local job's; on SLURM the tasks span nodes and derive it instead (:func:`rendezvous_port`)."""
    low, high = 10000, _EPHEMERAL_START
    if start is None:  # (a test passes its own)
        start = zlib.crc32(f"{os.getpid()}:{time.monotonic_ns()}".encode())
    for i in range(tries):
        port = low + (start + i * 7919) % (high - low)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds: TIME_WAIT is free
            try:
                sock.bind(("", port))
            except OSError:
                continue
        return port
    raise StageFailedError(
        f"no free rendezvous port for a local job in {tries} tries between {low} and {high}; free some ports"
    )
