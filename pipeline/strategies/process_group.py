"""Process-group set-up for stage tasks (the launcher exports MASTER_ADDR/PORT, RANK, WORLD_SIZE first)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.config.schema import StrategyConfig
from pipeline.errors import PipelineError

_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def init_distributed(strategy: StrategyConfig) -> torch.device:
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise PipelineError(
            f"cannot join the process group: {', '.join(missing)} not set (launch through the pipeline's launcher)"
        )
    dist.init_process_group(strategy.backend, timeout=timedelta(seconds=strategy.pg_timeout_s))
    if strategy.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def broadcast_from_rank0(value: Any) -> Any:
    """Hand rank 0's decision to every rank (bounded by the process group's timeout)."""
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
