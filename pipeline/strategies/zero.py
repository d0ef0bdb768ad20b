"""DeepSpeed ZeRO (stage 1, 2, 3) for the train stage: engine set-up and the save path through DeepSpeed.

* :func:`build_engine` wraps the model with ``deepspeed.initialize`` around a client ``torch.optim.AdamW`` (no
  DeepSpeed op is compiled: no FusedAdam/CPUAdam; DeepSpeed's CPU shared-memory allreduce op only with
  ``strategy.shm_comm=true``).
* The save and load of a step are the library's DeepSpeed adapter (:mod:`pipeline.checkpoint.save.deepspeed_engine`:
  :func:`save` through a hashing checkpoint engine, :func:`collect_offload` for NVMe offload, :func:`load_portable`
  through DeepSpeed's ``safe_set_full_*`` API; DeepSpeed's ``load_checkpoint`` is never used), re-exported here.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.save.deepspeed_engine import RecordingEngine, collect_offload, load_portable, save
from pipeline.config.schema import StrategyConfig
from pipeline.errors import ConfigError
from pipeline.formats.deepspeed_names import format_name

__all__ = [
    "RecordingEngine",
    "build_engine",
    "check_available",
    "collect_offload",
    "disable_shm_comm_op",
    "ds_config",
    "format_name",
    "load_portable",
    "save",
]

log = logging.getLogger(__name__)


def ds_config(strategy: StrategyConfig, micro_batch: int, accum: int = 1, clip: float | None = None) -> dict[str, Any]:
    """The DeepSpeed config for ``strategy``: ``accum`` micro batches of ``micro_batch`` per optimizer step,
    gradients clipped to ``clip`` (no DeepSpeed logging)."""
    zero: dict[str, Any] = {"stage": strategy.zero_stage}
    if strategy.offload != "none":
        target: dict[str, Any] = {"device": strategy.offload}
        if strategy.offload == "nvme":
            target["nvme_path"] = str(Path(strategy.nvme_path or "") / f"rank_{os.environ.get('RANK', '0')}")
        zero["offload_optimizer"] = dict(target)
        if strategy.zero_stage == 3:
            zero["offload_param"] = dict(target)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "train_batch_size": micro_batch * accum * strategy.world_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": strategy.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # the client torch AdamW also with offload: nothing compiled
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _quiet_deepspeed(strategy: StrategyConfig) -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if not strategy.shm_comm:
        disable_shm_comm_op()


def disable_shm_comm_op() -> None:
    """Keep DeepSpeed's CPU shared-memory allreduce op (``deepspeed_shm_comm``) from being built or loaded: its
    ``TorchBackend`` calls ``build_shm_op()`` when ``init_distributed`` wraps the process group, which JIT-compiles
    the op on first use (~25-45 s, needs a compiler) and loads it on every later run; gloo carries every collective.

    The module is taken from ``importlib``, not ``import deepspeed.comm.torch as m``: that statement binds the
    attribute ``torch`` of ``deepspeed.comm``, which ``from .comm import *`` sets to PyTorch itself, so the patch
    would land on ``torch`` and DeepSpeed would still build the op."""
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed is imported only when used
    ds_comm_torch.build_shm_op = lambda: None  # type: ignore[attr-defined]


def check_available(strategy: StrategyConfig) -> None:
    """Fail in one line before training when the configured offload cannot work on this machine."""
    if strategy.offload != "nvme":
        return
    from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ConfigError(
            "strategy.offload=nvme needs DeepSpeed's async_io op, which cannot be built here (libaio-dev missing?): "
            "install libaio-dev, or use strategy.offload=cpu"
        )


def build_engine(
    model: torch.nn.Module,
    strategy: StrategyConfig,
    opt: torch.optim.Optimizer,
    micro_batch: int,
    accum: int,
    clip: float | None,
) -> Any:
    """``deepspeed.initialize`` on the already-initialised process group, around the client optimizer ``opt``
    (whose param groups DeepSpeed drives: the LR scheduler is built on it); returns the engine."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if strategy.backend == "gloo" else "cuda")
    _quiet_deepspeed(strategy)
    check_available(strategy)
    import deepspeed  # noqa: PLC0415

    deepspeed.init_distributed(dist_backend=strategy.backend)  # joins the existing group
    config = ds_config(strategy, micro_batch, accum, clip)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    engine._copy_recovery_script = lambda *_a, **_k: None  # no zero_to_fp32.py copies: the pipeline consolidates
    return engine
