"""Every file and folder name of a DeepSpeed ZeRO step dir, defined once for the writer and the readers.

The train stage (:mod:`pipeline.strategies.zero`), the reader (:mod:`pipeline.formats.deepspeed_zero`) and the
format registry name DeepSpeed's files through this module only. It reads nothing but a listing and imports no
torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pipeline.errors import PipelineError

STAGE_OF: dict[str, int] = {f"deepspeed_zero{s}": s for s in (1, 2, 3)}
"""Format name (as written in markers and manifests) -> ZeRO stage."""

OPTIM_SUFFIX = "_optim_states.pt"
"""How every optimizer-state file's name ends."""
MODEL_SUFFIX = "_model_states.pt"
"""How every model-state file's name ends."""
MODEL_STATES_Z12 = f"mp_rank_00{MODEL_SUFFIX}"
"""ZeRO-1/2's one model-state file (written by rank 0)."""
OPTIM_RE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
"""An optimizer-state file: groups (bf16 prefix, data-parallel rank, model-parallel rank)."""

OFFLOAD_DIR = "offloaded_tensors"
"""Where DeepSpeed keeps the ranks' copies of their NVMe swap folders in a step dir (``rank<NN>`` under it)."""
OFFLOAD_RANK_RE = re.compile(r"rank(\d{2,})")
"""A rank's folder under :data:`OFFLOAD_DIR`."""
SWAP_RE = re.compile(r"(?:([A-Za-z_]\w*)-)?(\d+)_(\d+)\.tensor\.swp")
"""A swap file: groups (optimizer-state key or None for the fp32 partition, first ds_id, last ds_id)."""


def format_name(stage: int) -> str:
    """The manifest's ``format`` of a ZeRO checkpoint, ``deepspeed_zero{stage}`` for stage 1, 2 or 3 (what verify,
    consolidate and resume read it by)."""
    if stage not in (1, 2, 3):
        raise PipelineError(f"ZeRO stage {stage!r} does not exist: use 1, 2 or 3")
    return f"deepspeed_zero{stage}"


def optim_file(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00{OPTIM_SUFFIX}"


def z3_model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00{MODEL_SUFFIX}"


def offload_rank_name(rank: int) -> str:
    """Rank ``rank``'s folder name under :data:`OFFLOAD_DIR`: ``rank<NN>`` (at least two digits, as DeepSpeed's
    ``dp_index_to_str`` writes it)."""
    return f"rank{rank:02d}"


def offload_dir(rank: int) -> str:
    """Rank ``rank``'s copy of its NVMe swap folder, relative to the step dir (DeepSpeed's name)."""
    return f"{OFFLOAD_DIR}/{offload_rank_name(rank)}"


def swap_file(ds_ids: tuple[int, int], key: str = "fp32") -> str:
    """DeepSpeed's name of a swapped sub-group's file: ``<first>_<last>.tensor.swp`` for the fp32 partition,
    ``<key>-<first>_<last>.tensor.swp`` for an optimizer state (``exp_avg``, ``exp_avg_sq``)."""
    base = f"{ds_ids[0]}_{ds_ids[1]}.tensor.swp"
    return base if key == "fp32" else f"{key}-{base}"


def is_gradient_partition(name: str) -> bool:
    """Whether a file of a swap folder is a transient gradient partition (DeepSpeed's rule: never part of a
    checkpoint, so never copied into one nor read from one)."""
    return "gradient" in name


def is_zero_checkpoint(step_dir: Path) -> bool:
    """Whether ``step_dir`` holds DeepSpeed ZeRO optimizer-state files (by name only; nothing is read)."""
    try:
        return any(OPTIM_RE.fullmatch(n) for n in os.listdir(step_dir))
    except OSError:
        return False
