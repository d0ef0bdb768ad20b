"""DeepSpeed ZeRO as an adapter of the save session: a live engine's step in DeepSpeed's own layout, and its load.

* :func:`save` writes one step through ``engine.save_checkpoint`` into ``staging/step_N/`` (DeepSpeed's own
  layout, so its tools read it), with DeepSpeed's ``latest`` off and its recovery-script copies off. Every file
  goes through :class:`RecordingEngine`, which hashes while writing and fsyncs, so each rank knows exactly the
  files it wrote (its marker lists them; the commit is the pipeline's, never DeepSpeed's). With NVMe optimizer
  offload each rank copies its own swap folder into its own ``offloaded_tensors/rankNN/``
  (:func:`collect_offload`).
* DeepSpeed's checkpoint *loading* (``load_checkpoint``) is never used: it unpickles every file fully and refuses
  another world size. A step is loaded from its world-size-free view (:mod:`pipeline.checkpoint.save.portable`, or
  :class:`EngineView` of a ZeRO step) through DeepSpeed's ``safe_set_full_*`` API (:func:`load_portable`).
* For the library (:class:`~pipeline.checkpoint.Checkpointer`): :func:`find_engine` picks the engine out of a
  state dict, :func:`write_step` writes it and the rest of the state (as DCP files beside DeepSpeed's, in the same
  step), :func:`load_engine` loads a committed ZeRO step into an engine at any world size.

The app's train stage and a user's ``torchrun`` script drive the same functions through
:class:`~pipeline.checkpoint.save.session.CheckpointSession`. ``deepspeed`` is imported only when an engine is used.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.save import rank_save
from pipeline.checkpoint.save.portable import EXP_AVG, EXP_AVG_SQ, PARAM, ZeroWeights
from pipeline.checkpoint.save.rank_save import RankTarget, Written
from pipeline.errors import CheckpointFormatError, ConfigError, PipelineError
from pipeline.formats.dcp import _HashingStream
from pipeline.formats.deepspeed_names import OFFLOAD_DIR, format_name, is_gradient_partition, offload_dir
from pipeline.storage.atomic import copy_file_atomic, fsync_dir, remove_tree
from pipeline.storage.faults import inject, io_op
from pipeline.storage.integrity import FileEntry, lstat_kind

log = logging.getLogger(__name__)

__all__ = [
    "EngineView",
    "RecordingEngine",
    "collect_offload",
    "find_engine",
    "format_of",
    "load_engine",
    "load_portable",
    "save",
    "write_step",
]


def is_engine(value: object) -> bool:
    """Whether ``value`` is a DeepSpeed engine (without importing DeepSpeed: a process that made one has it)."""
    module = sys.modules.get("deepspeed.runtime.engine")
    return module is not None and isinstance(value, module.DeepSpeedEngine)


def find_engine(state: Mapping[str, Any]) -> str | None:
    """The key of ``state`` holding a DeepSpeed engine (None without one); two engines are refused."""
    keys = [k for k, v in state.items() if is_engine(v)]
    if len(keys) > 1:
        raise PipelineError(f"state holds DeepSpeed engines under {keys}: a step saves one engine")
    return keys[0] if keys else None


def format_of(engine: Any) -> str:
    """The step format an engine's saves have (``deepspeed_zero1|2|3``)."""
    return format_name(engine.zero_optimization_stage())


def client_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside the engine's ZeRO optimizer (whose param groups hold the flat partitions)."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"the DeepSpeed engine's optimizer {type(opt).__name__} is not a torch optimizer")
    return opt


class RecordingEngine:
    """A DeepSpeed checkpoint engine (``TorchCheckpointEngine``'s interface) writing each file through a hashing,
    fsyncing stream under ``root``; ``written`` lists this rank's files with sizes and xxh3-128 hashes."""

    def __new__(cls, root: Path) -> Any:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (  # noqa: PLC0415
            TorchCheckpointEngine,
        )

        class _Engine(TorchCheckpointEngine):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__(None)
                self.zipfile_serialization = True
                self.root = root
                self.written: list[FileEntry] = []

            def makedirs(self, path: str, exist_ok: bool = False) -> None:
                if not Path(path).is_dir():
                    io_op("mkdir", path)
                os.makedirs(path, exist_ok=True)

            def save(self, state_dict: Any, path: str) -> None:
                rel = os.path.relpath(path, self.root)
                if rel.startswith(".."):
                    raise OSError(f"DeepSpeed asked to write {path}, outside this step's staging dir {self.root}")
                inject("shard_save.deepspeed_file", rank=os.environ.get("RANK"), file=os.path.basename(path))
                io_op("create", path)
                with open(path, "wb") as raw:
                    stream = _HashingStream(raw, path)
                    torch.save(state_dict, stream)  # type: ignore[arg-type]
                    stream.close()
                self.written.append(FileEntry(path=rel, size=stream.size, hash=stream.hasher.hexdigest()))

        return _Engine()


def _swap_folder(engine: Any) -> Path | None:
    """This rank's DeepSpeed optimizer swap folder when the optimizer state lives on NVMe, else None."""
    if not getattr(engine.optimizer, "swap_optimizer", False):
        return None
    return Path(engine.optimizer.optimizer_swapper.swap_folder)


def collect_offload(swap_folder: Path, step_dir: Path, rank: int) -> list[FileEntry]:
    """Copy this rank's NVMe swap folder into its own ``offloaded_tensors/rank<NN>/`` of ``step_dir``; return
    the copies (paths relative to ``step_dir``, sizes and xxh3-128 hashes of the bytes written).

    What DeepSpeed's own save copies, and how: every file of the swap folder (the fp32 master partitions and
    the Adam state, ``<ds_id>.tensor.swp`` / ``exp_avg-<ds_id>.tensor.swp``...) except the transient gradient
    partitions (names containing ``gradient``). Each file is copied atomically (temp file, fsync, rename) and
    hashed while copied. Only this rank ever creates or writes ``rank<NN>``: the shared ``offloaded_tensors``
    parent is only ``mkdir``-ed (idempotent), never a copy destination. A ``rank<NN>`` left by an earlier
    attempt of this same rank is removed first (nobody else writes it)."""
    if lstat_kind(swap_folder) != "dir":
        raise CheckpointFormatError(
            f"DeepSpeed's NVMe swap folder {swap_folder} of rank {rank} is {lstat_kind(swap_folder) or 'missing'}: "
            "the optimizer state cannot be saved; check strategy.nvme_path (node-local, not cleaned during training)"
        )
    parent = step_dir / OFFLOAD_DIR
    io_op("mkdir", parent)
    parent.mkdir(exist_ok=True)  # every rank may create it: exist_ok makes that race harmless
    rel_dir = offload_dir(rank)
    own = step_dir / rel_dir
    if lstat_kind(own) is not None:
        remove_tree(own)
    io_op("mkdir", own)
    own.mkdir()  # exclusive: a second creator would fail here, never overwrite
    entries: list[FileEntry] = []

    def copy_dir(src: Path, dst: Path, rel: str) -> None:
        for name in sorted(os.listdir(src)):
            if is_gradient_partition(name):  # DeepSpeed's rule: gradient partitions are not part of a checkpoint
                continue
            kind = lstat_kind(src / name)
            if kind == "dir":
                io_op("mkdir", dst / name)
                (dst / name).mkdir()
                copy_dir(src / name, dst / name, f"{rel}/{name}")
                fsync_dir(dst / name)
            elif kind == "file":
                size, digest = copy_file_atomic(src / name, dst / name)
                entries.append(FileEntry(path=f"{rel}/{name}", size=size, hash=digest))
            else:
                raise CheckpointFormatError(
                    f"{src / name} in DeepSpeed's NVMe swap folder of rank {rank} is a {kind}, not a swap file: "
                    "remove it (nothing there is followed or copied but regular files)"
                )

    copy_dir(swap_folder, own, rel_dir)
    fsync_dir(own)
    fsync_dir(parent)
    return entries


def save(engine: Any, staging_area: Path, step_dir_name: str) -> list[FileEntry]:
    """Every rank: DeepSpeed writes this rank's files of the step into ``staging_area/step_dir_name/``; returns
    them (relative to that dir). DeepSpeed's ``latest`` is not written: the pipeline's committer publishes.

    With NVMe optimizer offload, DeepSpeed's own copy of the swap folder is switched off for the call, and
    :func:`collect_offload` copies this rank's swap folder into this rank's own ``offloaded_tensors/rank<NN>/``
    afterwards; those files are listed too (the registry names rank NN their owner). No destination is ever
    written by more than one task: each rank copies only its own folder, into a directory that only it
    creates, and the shared ``offloaded_tensors`` parent is only ``mkdir(exist_ok=True)``-ed. That is what
    makes seed 000 (DeepSpeed bug 7549: every rank ``copytree``-ing into one shared ``offloaded_tensors``,
    the losers dying with FileExistsError) impossible here: DeepSpeed's own copy (the one that raced, in
    0.16.x) is never relied on; 0.19.8 gates it by ``engine.zero_nvme_offload_optimizer()``, False during
    the call."""
    step_dir = staging_area / step_dir_name
    recorder = RecordingEngine(step_dir)
    previous = engine.checkpoint_engine
    swap_folder = _swap_folder(engine)
    engine.checkpoint_engine = recorder
    if swap_folder is not None:
        engine.zero_nvme_offload_optimizer = lambda: False  # only save_checkpoint's copytree asks it while saving
    try:
        engine.save_checkpoint(str(staging_area), tag=step_dir_name, save_latest=False)
    finally:
        engine.checkpoint_engine = previous
        if swap_folder is not None:
            del engine.zero_nvme_offload_optimizer
    written = list(recorder.written)
    if swap_folder is not None:
        written += collect_offload(swap_folder, step_dir, engine.global_rank)
    return written


def load_portable(engine: Any, opt: torch.optim.Optimizer, portable: Any, stage: int) -> None:
    """Load a world-size-free step into a fresh engine: fp32 master weights and Adam state through DeepSpeed's
    ``safe_set_full_*`` (each rank keeps its partition), the low-precision module weights from the same fp32
    values (cast as DeepSpeed casts after a step), and Adam's step count."""
    import deepspeed  # noqa: PLC0415
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # noqa: PLC0415

    params = list(engine.module.named_parameters())
    missing = sorted({n for n, _ in params} - set(portable.names))
    if missing:
        raise ConfigError(f"the checkpoint lacks parameters of this model: {missing[:5]}")
    step = portable.optim_step()
    # AdamW creates its state lazily at the first step: create it now. ZeRO-1/2 keep their flat partitions in the
    # param groups; ZeRO-3 puts each sub-group's flat partition there only while it steps.
    flats = [p for group in opt.param_groups for p in group["params"]]
    flats += list(getattr(engine.optimizer, "fp32_partitioned_groups_flat", []))
    for flat in flats:
        if not opt.state.get(flat):
            opt.state[flat] = {
                "step": step.clone(),
                "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format),
            }
    zero_opt = engine.optimizer  # ZeRO-1/2 link each parameter to its Adam state after the first step: now
    if hasattr(zero_opt, "_lazy_init_hp_params_optimizer_state"):
        zero_opt._hp_optimizer_states_linked = False
        zero_opt._lazy_init_hp_params_optimizer_state()
    for name, param in params:
        full = portable.tensor(name, PARAM)
        if tuple(full.shape) != tuple(getattr(param, "ds_shape", param.shape)):
            raise ConfigError(f"parameter {name}: the checkpoint has shape {tuple(full.shape)}, the model another")
        safe_set_full_fp32_param(param, full)
        for key in (EXP_AVG, EXP_AVG_SQ):
            safe_set_full_optimizer_state(param, portable.tensor(name, key), key)
        if stage == 3:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(full.to(param.dtype))
        else:
            param.data.copy_(full.to(param.dtype))
    for state in opt.state.values():
        if "step" in state:
            state["step"] = step.clone() if torch.is_tensor(state["step"]) else float(step)


EngineView = ZeroWeights
"""A committed ZeRO step as :func:`load_portable` reads it, without the app's training state (what a library step
holds beside it is DCP)."""


def load_engine(engine: Any, step_dir: Path, manifest: Manifest) -> None:
    """Load the committed ZeRO step at ``step_dir`` into ``engine`` (any world size, any ZeRO stage): weights and
    Adam state; what else the engine keeps (its LR scheduler, its step counters) is not restored here: give
    the state dict the scheduler under a key of its own."""
    if not manifest.format.startswith("deepspeed_zero"):
        raise CheckpointFormatError(
            f"{step_dir} was saved as {manifest.format}, without a DeepSpeed engine: a DeepSpeed engine loads only "
            "steps saved from one (deepspeed_zero1|2|3)"
        )
    view = EngineView(step_dir)
    try:
        load_portable(engine, client_optimizer(engine), view, engine.zero_optimization_stage())
    finally:
        view.close()


def write_step(target: RankTarget, staged: Path, engine: Any, rest: dict[str, Any], group: Any) -> Written:
    """The library's DeepSpeed step, this rank's part: DeepSpeed's files (:func:`save`), then the rest of the
    state (the step number and the user's other values, e.g. a scheduler, a data loader, :class:`RankRNG`) as
    DCP files beside them (``__K_*.distcp``, rank 0's ``.metadata``), all listed by this rank's marker."""
    files = save(engine, staged.parent, staged.name)
    other = rank_save.write_dcp(target, staged, rest, group)
    return Written((*files, *other.entries))
