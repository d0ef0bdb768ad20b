"""The world-size-free view of a committed step, for resuming under another world size or strategy.

Any committed format (DCP from DDP/FSDP2, DeepSpeed ZeRO 1/2/3) is read as: per parameter (Hugging Face name)
its full fp32 value and its full Adam ``exp_avg``/``exp_avg_sq``; the Adam step; and the training state (step,
data position, LR scheduler, each rank's RNG). Nothing here depends on how many ranks wrote the step or how they
were sharded. A target strategy loads it with :func:`apply_native` (DDP/FSDP2, through
``torch.distributed.checkpoint.state_dict.set_state_dict``) or :func:`pipeline.strategies.zero.load_portable`
(DeepSpeed, through its ``safe_set_full_*`` API).

Bytes are read without unpickling code: DCP through the restricted reader of :mod:`pipeline.formats.dcp`,
DeepSpeed files through :mod:`pipeline.formats.torch_zip`, the training state of a DeepSpeed step from JSON.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.save.state import MODEL, OPTIM, RNG, SCHED, TRAIN
from pipeline.errors import CheckpointFormatError
from pipeline.formats.dcp_metadata import TensorStorageMetadata
from pipeline.storage.atomic import write_json_atomic
from pipeline.storage.integrity import FileEntry, describe, read_record_json

PARAM, EXP_AVG, EXP_AVG_SQ = "param", "exp_avg", "exp_avg_sq"
OPTIM_KEYS = (EXP_AVG, EXP_AVG_SQ)


def train_state_file(rank: int) -> str:
    """A DeepSpeed step's per-rank training state (JSON, written by that rank beside DeepSpeed's files)."""
    return f"train_state_rank_{rank}.json"


@dataclass
class TrainState:
    """Everything but model and optimizer: where training stands and how to continue it identically."""

    step: int
    data_epoch: int
    data_offset: int
    sched: dict[str, Any]
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """``rank_K`` (CPU generator), ``rank_K_cuda``: the ranks that wrote the step."""

    def to_json(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s JSON form: the shared fields and that rank's generators only."""
        own = {k: v for k, v in self.rng.items() if k in (f"rank_{rank}", f"rank_{rank}_cuda")}
        return {
            "step": self.step,
            "data_epoch": self.data_epoch,
            "data_offset": self.data_offset,
            "sched": self.sched,
            "rng": {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in own.items()},
        }


def write_train_state(step_dir: Path, rank: int, state: TrainState) -> FileEntry:
    name = train_state_file(rank)
    write_json_atomic(step_dir / name, state.to_json(rank))
    return describe(step_dir, name)


def read_train_state(step_dir: Path, world_size: int) -> TrainState:
    """Rank 0's file for the shared fields, every rank's file for its generator."""
    states = []
    for rank in range(world_size):
        path = step_dir / train_state_file(rank)
        try:
            obj = read_record_json(path, "training state")
        except FileNotFoundError:
            raise CheckpointFormatError(f"{path} is missing: rank {rank}'s training state of this step") from None
        states.append((path, obj))
    path, first = states[0]
    try:
        state = TrainState(
            step=int(first["step"]),
            data_epoch=int(first["data_epoch"]),
            data_offset=int(first["data_offset"]),
            sched=dict(first["sched"]),
        )
        for _, obj in states:
            for key, text in dict(obj["rng"]).items():
                raw = bytearray(base64.b64decode(str(text), validate=True))
                state.rng[str(key)] = torch.frombuffer(raw, dtype=torch.uint8).clone() if raw else torch.empty(0)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointFormatError(f"{path}: malformed training state ({e}); restore the step from a copy") from None
    return state


class Portable(Protocol):
    """A committed step, world-size-free."""

    names: list[str]
    """Parameter names (Hugging Face), in the model's order."""
    train: TrainState

    def tensor(self, name: str, key: str) -> torch.Tensor:
        """Full fp32 ``PARAM``, ``EXP_AVG`` or ``EXP_AVG_SQ`` of parameter ``name`` (a fresh tensor)."""
        ...

    def optim_step(self) -> torch.Tensor:
        """Adam's step count (0-d float32), shared by every parameter."""
        ...

    def close(self) -> None:
        """Release open files."""
        ...


class _DcpPortable:
    """A DCP step (DDP/FSDP2) read key by key with ``no_dist`` loads into full-size tensors."""

    MODEL, OPTIM = f"{MODEL}.", f"{OPTIM}.state."

    def __init__(self, step_dir: Path) -> None:
        from pipeline.formats.dcp import load_into, read_metadata_safe  # noqa: PLC0415

        self._load_into = load_into
        self.step_dir = step_dir
        self.metadata = read_metadata_safe(step_dir)
        meta = self.metadata.state_dict_metadata
        self.names = [k[len(self.MODEL) :] for k in meta if k.startswith(self.MODEL)]
        plain: dict[str, Any] = {
            SCHED: {k.split(".", 1)[1]: 0 for k in meta if k.startswith(f"{SCHED}.")},
            TRAIN: {k.split(".", 1)[1]: torch.tensor(0) for k in meta if k.startswith(f"{TRAIN}.")},
            RNG: {k.split(".", 1)[1]: self._empty(k) for k in meta if k.startswith(f"{RNG}.")},
        }
        load_into(plain, step_dir, no_dist=True, metadata=self.metadata)
        self.train = TrainState(
            step=int(plain[TRAIN]["step"]),
            data_epoch=int(plain[TRAIN]["data_epoch"]),
            data_offset=int(plain[TRAIN]["data_offset"]),
            sched=plain[SCHED],
            rng=plain[RNG],
        )

    def _empty(self, key: str) -> torch.Tensor:
        item = self.metadata.state_dict_metadata.get(key)
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointFormatError(f"{self.step_dir}: the checkpoint has no tensor {key!r} (not a training step)")
        return torch.empty(tuple(item.size), dtype=item.properties.torch_dtype())

    def _read(self, key: str) -> torch.Tensor:
        out = self._empty(key)
        self._load_into({key: out}, self.step_dir, no_dist=True, metadata=self.metadata)
        return out

    def tensor(self, name: str, key: str) -> torch.Tensor:
        if key == PARAM:
            return self._read(self.MODEL + name).float()
        return self._read(f"{self.OPTIM}{name}.{key}")

    def optim_step(self) -> torch.Tensor:
        return self._read(f"{self.OPTIM}{self.names[0]}.step").float().reshape(())

    def close(self) -> None:
        """Nothing stays open between reads."""


class ZeroWeights:
    """A DeepSpeed ZeRO step: fp32 master weights and Adam state sliced out of the flat partitions (every
    parameter's full value, Adam's step); the library's DeepSpeed adapter loads an engine from it too."""

    _KEYS = {PARAM: "fp32", EXP_AVG: "exp_avg", EXP_AVG_SQ: "exp_avg_sq"}

    def __init__(self, step_dir: Path) -> None:
        from pipeline.formats.deepspeed_zero import ZeroCheckpoint  # noqa: PLC0415 - reads no torch DCP

        self.ckpt = ZeroCheckpoint(step_dir)
        self.names = [s.name for s in self.ckpt.param_specs()]

    def tensor(self, name: str, key: str) -> torch.Tensor:
        return self.ckpt.full(name, self._KEYS[key]).float()

    def optim_step(self) -> torch.Tensor:
        step = self.ckpt.optimizer_step()
        if step is None:
            raise CheckpointFormatError(f"{self.ckpt.step_dir}: the optimizer state holds no Adam step")
        return step.float().reshape(())

    def close(self) -> None:
        self.ckpt.close()


class _ZeroPortable(ZeroWeights):
    """A ZeRO step written by the app's train: its weights, with each rank's training state beside them."""

    def __init__(self, step_dir: Path, world_size: int) -> None:
        super().__init__(step_dir)
        self.train = read_train_state(step_dir, world_size)


def open_portable(step_dir: Path, manifest: Manifest) -> Portable:
    """The world-size-free view of a committed (verified) step, chosen by its manifest's format."""
    if manifest.format == "torch_dcp":
        return _DcpPortable(step_dir)
    if manifest.format.startswith("deepspeed_zero"):
        return _ZeroPortable(step_dir, manifest.world_size)
    raise CheckpointFormatError(
        f"{step_dir}: format {manifest.format!r} cannot be resumed from (it holds weights only; consolidate/export it)"
    )


def apply_native(model: torch.nn.Module, opt: torch.optim.Optimizer, portable: Portable) -> None:
    """Load ``portable`` into a DDP or FSDP2 model and its AdamW (each rank keeps its own shard)."""
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    _, current = get_state_dict(model, opt, options=options)
    step = portable.optim_step()
    groups: list[dict[str, Any]] = current["param_groups"]  # type: ignore[assignment]
    wanted: list[str] = [p for g in groups for p in g["params"]]
    missing = sorted(set(wanted) - set(portable.names))
    if missing:
        raise CheckpointFormatError(f"the checkpoint lacks parameters of this model: {missing[:5]}")
    msd = {name: portable.tensor(name, PARAM) for name in wanted}
    state = {name: {"step": step.clone(), **{k: portable.tensor(name, k) for k in OPTIM_KEYS}} for name in wanted}
    set_state_dict(
        model,
        opt,
        model_state_dict=msd,  # type: ignore[arg-type]
        optim_state_dict={"state": state, "param_groups": groups},  # type: ignore[dict-item]
        options=options,
    )
