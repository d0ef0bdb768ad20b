"""Process-group set-up for stage tasks (the launcher exports MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.config.schema import StrategyConfig
from pipeline.errors import PipelineError
from pipeline.strategies.devices import claim_cuda_device, make_cuda_deterministic

_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def init_distributed(strategy: StrategyConfig) -> torch.device:
    """Join the job's process group; returns this rank's device (``cuda:LOCAL_RANK`` for nccl, else CPU)."""
    needed = (*_ENV, "LOCAL_RANK") if strategy.backend == "nccl" else _ENV  # LOCAL_RANK picks the GPU
    missing = [k for k in needed if k not in os.environ]
    if missing:
        raise PipelineError(
            f"cannot join the process group: {', '.join(missing)} not set (launch through the pipeline's launcher)"
        )
    timeout = timedelta(seconds=strategy.pg_timeout_s)
    if strategy.backend != "nccl":
        dist.init_process_group(strategy.backend, timeout=timeout)
        return torch.device("cpu")
    # The device is current before the group exists: NCCL's communicator, object collectives and barriers use
    # the current device, and device_id binds the group to it (no rank guesses, no init on cuda:0 by all ranks).
    device = claim_cuda_device(int(os.environ["LOCAL_RANK"]), rank=int(os.environ["RANK"]))
    make_cuda_deterministic()
    dist.init_process_group(strategy.backend, timeout=timeout, device_id=device)
    return device


def broadcast_from_rank0(value: Any) -> Any:
    """Hand rank 0's decision to every rank (bounded by the process group's timeout)."""
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
