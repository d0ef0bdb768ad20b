"""The cluster does what the pipeline relies on: submitit runs functions and multi-task gloo jobs on it, and
``job_alive`` tells a running job from a cancelled one."""

from __future__ import annotations

import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import submitit
import torch
import torch.distributed as dist

from pipeline.stagekit.jobs import job_alive
from tests.slurm.conftest import SlurmCluster, sacct_states, settled_states, wait_for_jobs

pytestmark = pytest.mark.xdist_group("slurm")  # one xdist worker: the session's one cluster

JOB_TIMEOUT_S = 60
TIME_LIMIT_MIN = 5
"""The jobs' time limit. submitit asks for ``--signal=USR2@90`` (its ``slurm_signal_delay_s``), and SLURM may send
that signal up to 60 s early (sbatch(1); slurmctld checks on a periodic pass), so under a 2-minute limit it can
come at once, before the tasks have imported anything to handle it with: a fresh-clone run's gloo job was killed
by USR2 1.3 s after it was allocated (slurmctld.log: WEXITSTATUS 140). Under 5 minutes it cannot come in the
first 150 s, well after ``JOB_TIMEOUT_S``."""


def _executor(cluster: SlurmCluster, folder: Path, **params: int) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
    executor.update_parameters(slurm_partition=cluster.partition, timeout_min=TIME_LIMIT_MIN, **params)
    return executor


def _square(x: int) -> int:
    return x * x


def _all_reduce_rank() -> tuple[int, int, float]:
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    try:
        value = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(value)
        return env.rank, env.world_size, value.item()
    finally:
        dist.destroy_process_group()


def test_submitit_runs_a_function(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = _executor(slurm_cluster, tmp_path).submit(_square, 7)
    wait_for_jobs([job.job_id], JOB_TIMEOUT_S)
    assert job.result() == 49
    # the job returned its result: accounting must come to say COMPLETED (it may say FAILED for a while first)
    assert settled_states([job.job_id], "COMPLETED") == {job.job_id: "COMPLETED"}


def test_two_tasks_join_a_gloo_group(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = _executor(slurm_cluster, tmp_path, nodes=1, tasks_per_node=2, cpus_per_task=1).submit(_all_reduce_rank)
    wait_for_jobs([job.job_id], JOB_TIMEOUT_S)
    assert sorted(job.results()) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_job_alive_follows_a_cancelled_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id = subprocess.run(
        ["sbatch", "--parsable", "-p", slurm_cluster.partition, "-t", "2", "-J", "job-alive-test"]
        + ["-o", str(tmp_path / "%j.out"), "--wrap", "sleep 30"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while sacct_states([job_id]).get(job_id) != "RUNNING":
            assert time.monotonic() < deadline, f"job {job_id} not running: {sacct_states([job_id])}"
            time.sleep(0.2)
        assert job_alive("slurm", job_id) is True
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=True)
    deadline = time.monotonic() + 30
    while job_alive("slurm", job_id) is not False:
        assert time.monotonic() < deadline, f"job {job_id} still alive 30 s after scancel: {sacct_states([job_id])}"
        time.sleep(0.2)
    assert settled_states([job_id], "CANCELLED") == {job_id: "CANCELLED"}
