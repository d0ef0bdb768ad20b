"""CUDA devices for the NCCL backend: a check in the launching process, and each task's claim of its GPU.

The launching process only counts devices (:func:`check_backend`): ``torch.cuda.device_count()`` asks NVML and
leaves CUDA uninitialised there (``torch.cuda.is_available()`` would call ``cudaGetDeviceCount`` and poison
``fork`` for the rest of the process). Each train task then claims ``cuda:LOCAL_RANK`` (:func:`claim_cuda_device`):
every task of a node sees all of the node's GPUs and its index on the node picks one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pipeline.config.schema import StrategyConfig
from pipeline.errors import ConfigError, PipelineError

if TYPE_CHECKING:
    import torch


def _visible() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES is unset" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def check_backend(strategy: StrategyConfig) -> None:
    """Fail before any job starts when ``strategy.backend=nccl`` cannot have one visible GPU per rank here.

    For launchers whose train job runs on this machine (local); a SLURM login node need not have GPUs.
    """
    if strategy.backend != "nccl":
        return
    import torch  # noqa: PLC0415 - only for nccl: planning and every stage job start without torch

    if not torch.backends.cuda.is_built():
        raise ConfigError(
            f"strategy.backend=nccl needs CUDA but torch {torch.__version__} is a CPU-only build: "
            "use strategy.backend=gloo, or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(
            f"strategy.backend=nccl needs a GPU per rank but no CUDA device is visible ({_visible()}): "
            "use strategy.backend=gloo"
        )
    if count < strategy.world_size:
        raise ConfigError(
            f"strategy.backend=nccl with strategy.world_size={strategy.world_size} needs {strategy.world_size} GPUs "
            f"but {count} are visible ({_visible()}): use strategy.world_size={count}, or strategy.backend=gloo"
        )


def claim_cuda_device(local_rank: int, rank: int) -> torch.device:
    """Make ``cuda:local_rank`` this task's current device (before the process group binds to it)."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise PipelineError(
            f"rank {rank}: strategy.backend=nccl but this task sees no CUDA device ({_visible()}): "
            "request GPUs for the train job, or use strategy.backend=gloo"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise PipelineError(
            f"rank {rank}: LOCAL_RANK={local_rank} but this task sees only {count} CUDA device(s) ({_visible()}): "
            "every task on a node needs the node's GPUs visible, one per task; request as many GPUs per node as "
            "tasks per node, or lower strategy.world_size"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def make_cuda_deterministic() -> None:
    """Deterministic CUDA kernels, so a resumed run ends bit-identical to an uninterrupted one (as on CPU).

    Without it the memory-efficient attention backward splits keys across blocks and sums with atomics, so two
    runs of the same steps differ in the last bits. ``warn_only`` is not used: it keeps that split. cuBLAS reads
    ``CUBLAS_WORKSPACE_CONFIG`` at its first call, so this runs before any kernel (a user's value is kept).
    """
    import torch  # noqa: PLC0415

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
