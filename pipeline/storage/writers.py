"""How many files a rank writes in parallel when nobody said: the CPUs it has to itself, at most 4."""

from __future__ import annotations

import os

MAX_WRITER_THREADS = 4


def auto_writer_threads(world_size: int) -> int:
    """``SLURM_CPUS_PER_TASK`` when set, else this machine's CPUs over the ranks on it (``world_size``)."""
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    cpus = int(per_task) if per_task.isdigit() else len(os.sched_getaffinity(0)) // max(1, world_size)
    return max(1, min(MAX_WRITER_THREADS, cpus))
