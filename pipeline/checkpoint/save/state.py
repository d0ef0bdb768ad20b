"""The state-dict key schema: how a training state becomes a DCP state dict and comes back.

Keys shared by the library's :class:`~pipeline.checkpoint.Checkpointer` and the app's train stage
(:mod:`pipeline.checkpoint.save.portable` and consolidation read them):

* ``model``: the model's state dict from torch's ``get_state_dict`` (DDP's ``module.`` prefix stripped, FSDP2's
  DTensors kept sharded), so a step reshards on load and consolidates to full tensors (``model.<name>``);
* ``optim``: the optimizer's, keyed by parameter name (``optim.state.<name>.exp_avg``...);
* ``checkpointer``: ``{"step": tensor}``, the step the state was saved at (checked on load);
* any other key: a DCP ``Stateful`` (``state_dict``/``load_state_dict``: an LR scheduler, a ``torchdata``
  ``StatefulDataLoader``) or a plain state dict. Values that differ per rank go under :class:`RankLocal` (rank
  ``K``'s under ``rank_K``): DCP keeps one copy of a key that every rank has.

The app's train stage also writes ``sched`` (the LR scheduler's state dict), ``train`` (``step``,
``data_epoch``, ``data_offset``) and ``rng`` (``rank_K``: CPU generator, ``rank_K_cuda``: its GPU's).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from pipeline.checkpoint.save.pieces import shared_groups
from pipeline.errors import PipelineError
from pipeline.formats.dcp import load_into
from pipeline.formats.dcp_metadata import Metadata, TensorStorageMetadata, read_metadata_safe
from pipeline.formats.dcp_values import TorchName

log = logging.getLogger(__name__)

MODEL, OPTIM, STEP_KEY = "model", "optim", "checkpointer"
SCHED, TRAIN, RNG = "sched", "train", "rng"
"""The app's further keys (its train stage)."""


def rng_key(rank: int, cuda: bool = False) -> str:
    """The app's per-rank generator key under ``rng``."""
    return f"rank_{rank}_cuda" if cuda else f"rank_{rank}"


class RankLocal:
    """A value that differs per rank (a data loader's position, a sampler): saved under ``rank_<K>``.

    On load at another world size a rank the step did not have keeps its current state (and says so).
    """

    def __init__(self, obj: Any, rank: int) -> None:
        self.obj, self.rank = obj, rank

    def state_dict(self) -> dict[str, Any]:
        return {f"rank_{self.rank}": self.obj.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.obj.load_state_dict(sd[f"rank_{self.rank}"])


class _RNG:
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state()
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(sd["cpu"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["cuda"])


def RankRNG(rank: int) -> RankLocal:  # noqa: N802 - a constructor
    """This rank's torch generators (CPU, and the current CUDA device's), as a per-rank state value."""
    return RankLocal(_RNG(), rank)


def save_state(state: dict[str, Any], step: int, rank: int) -> dict[str, Any]:
    """``state`` as the DCP state dict to save (or to load into: the same structure)."""
    if STEP_KEY in state:
        raise PipelineError(f"state key {STEP_KEY!r} is the checkpointer's own: rename yours")
    out: dict[str, Any] = {}
    model, opt = state.get(MODEL), state.get(OPTIM)
    if isinstance(model, torch.nn.Module):
        if isinstance(opt, torch.optim.Optimizer):
            out[MODEL], out[OPTIM] = get_state_dict(model, opt)
        else:
            out[MODEL] = get_model_state_dict(model)
    for key, value in state.items():
        if key in out:
            continue
        if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
            raise PipelineError(
                f"state[{key!r}] is a {type(value).__name__}: put the model under {MODEL!r} and its optimizer "
                f"under {OPTIM!r} (they are saved together, by parameter name)"
            )
        out[key] = value.state_dict() if isinstance(value, Stateful) else value
    out[STEP_KEY] = {"step": torch.tensor(step)}
    return out


def piece_groups(state: dict[str, Any]) -> dict[str, str]:
    """The FQNs of ``state``'s model saved as shared pieces (its frozen parameters and buffers); none without one."""
    model = state.get(MODEL)
    return shared_groups(model, MODEL) if isinstance(model, torch.nn.Module) else {}


def load_state(
    into: dict[str, Any],
    step_dir: Path,
    group: Any,
    rank: int,
    same_world: bool,
    *,
    exclude: tuple[str, ...] = (),
    partial: bool = False,
) -> int:
    """Load the step at ``step_dir`` into ``into`` (through the restricted reader: nothing is unpickled beyond
    tensors and plain containers); returns the step it records. At another world size, per-rank values of
    ranks the step did not have are left as they are. Keys in ``exclude`` are not loaded; with ``partial``, values
    the step does not hold (a key the state gained since) keep their current value, named in a WARNING."""
    skipped = [k for k, v in into.items() if isinstance(v, RankLocal)] if not same_world else []
    if skipped:
        log.warning("rank %d: %s not restored: the step was saved at another world size", rank, ", ".join(skipped))
    wanted = {k: v for k, v in into.items() if k not in skipped and k not in exclude}
    metadata = read_metadata_safe(step_dir)
    target = shaped_as_saved(save_state(wanted, 0, rank), metadata, rank)
    hint = ": pass partial=True to load the rest and keep its current value, or exclude=[its top-level key]"
    missing = load_into(target, step_dir, process_group=group, partial=partial, hint=hint, metadata=metadata)
    if missing and rank == 0:
        log.warning("%s holds no value for %s: kept as they were (partial=True)", step_dir, ", ".join(missing))
    step = apply_state(wanted, target)
    into.update({k: wanted[k] for k in wanted})
    return step


def shaped_as_saved(target: dict[str, Any], metadata: Metadata, rank: int) -> dict[str, Any]:
    """``target`` with every value but the model's and optimizer's rebuilt in the structure the step saved
    (``metadata``'s flattening paths): a list that grew, a dict with other keys, a value that was None load as
    saved, not as the fresh state happens to hold them. A tensor of the fresh state at the same path and shape
    is kept (loaded in place, on its device); a key the step does not hold stays as it is."""
    paths: dict[str, list[tuple[tuple[Any, ...], Any]]] = {}
    for flat, path in (metadata.planner_data or {}).items():
        if isinstance(path, tuple) and path and isinstance(path[0], str) and path[0] not in (MODEL, OPTIM, STEP_KEY):
            paths.setdefault(path[0], []).append((path, metadata.state_dict_metadata.get(flat)))
    out = dict(target)
    for key, entries in paths.items():
        if key not in target or isinstance(target[key], torch.Tensor):
            continue
        mine = [(p, m) for p, m in entries if not (len(p) > 1 and _other_rank(p[1], rank))]
        out[key] = _with_new_keys(_rebuild(mine, target[key]), target[key])
    return out


def _with_new_keys(saved: Any, current: Any) -> Any:
    """``saved`` with the dict keys only ``current`` has (a key the state gained: absent from the step)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for k, v in current.items():
            saved[k] = _with_new_keys(saved[k], v) if k in saved else v
    return saved


def _other_rank(part: Any, rank: int) -> bool:
    return isinstance(part, str) and part.startswith("rank_") and part != f"rank_{rank}"


def _rebuild(entries: list[tuple[tuple[Any, ...], Any]], current: Any) -> Any:
    """The nested dicts and lists ``entries`` (path from the top-level key, storage metadata) describe."""
    root: dict[str, Any] = {}
    for path, meta in entries:  # in the order the step flattened them (a dict keeps its key order)
        node: Any = root
        trail = ("",) + path[1:]
        for i, part in enumerate(trail[:-1]):
            nxt = trail[i + 1]
            child: Any = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                node[part] = node[part] if node[part] is not None else child
                node = node[part]
            else:
                node = node.setdefault(part, child)
        leaf = trail[-1]
        value = _placeholder(meta, _at(current, path[1:]))
        if isinstance(node, list):
            while len(node) <= leaf:
                node.append(None)
            node[leaf] = value
        else:
            node[leaf] = value
    return root[""]


def _at(current: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        try:
            current = current[part]
        except (KeyError, IndexError, TypeError):
            return None
    return current


def _placeholder(meta: Any, current: Any) -> Any:
    """What DCP loads a value into: the fresh state's tensor when it fits, else an empty one; None for bytes."""
    if isinstance(meta, TensorStorageMetadata):
        if isinstance(current, torch.Tensor) and tuple(current.shape) == tuple(meta.size):
            return current
        dtype = meta.properties.dtype
        return torch.empty(tuple(meta.size), dtype=dtype.resolve() if isinstance(dtype, TorchName) else dtype)
    return None


def apply_state(wanted: dict[str, Any], target: dict[str, Any]) -> int:
    """Hand the loaded state dict ``target`` (:func:`save_state`'s structure) to ``wanted``'s objects, and its
    plain values (numbers, strings, containers) to ``wanted`` itself; returns the step it records."""
    model, opt = wanted.get(MODEL), wanted.get(OPTIM)
    if isinstance(model, torch.nn.Module):
        if isinstance(opt, torch.optim.Optimizer):
            set_state_dict(model, opt, model_state_dict=target[MODEL], optim_state_dict=target[OPTIM])
        else:
            set_model_state_dict(model, target[MODEL])
    for key, value in wanted.items():
        if key in (MODEL, OPTIM) and isinstance(model, torch.nn.Module):
            continue  # set above, by parameter name
        if isinstance(value, Stateful):
            value.load_state_dict(target[key])
        elif not isinstance(value, torch.Tensor) and key in target:
            wanted[key] = target[key]  # DCP replaced the value in target (a tensor it loaded in place)
    return int(target[STEP_KEY]["step"])
