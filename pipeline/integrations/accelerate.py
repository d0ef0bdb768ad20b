"""Hugging Face Accelerate on the commit protocol: :func:`save_state` / :func:`load_state`, a drop-in pair for
``accelerator.save_state()`` / ``accelerator.load_state()``.

    from pipeline.integrations.accelerate import close, load_state, save_state

    config = ProjectConfiguration(project_dir="runs/acc", automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=config)
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
    start = load_state(accelerator)      # was: accelerator.load_state(); the newest *committed* step (0: none)
    ...
    save_state(accelerator, step)        # was: accelerator.save_state()
    close(accelerator)                   # every staged step committed, the checkpointer closed

Why a pair of functions, not Accelerate's hooks: ``register_save_state_pre_hook`` runs inside
``Accelerator.save_state`` after its ``total_limit`` rotation has ``rmtree``-ed the oldest ``checkpoint_N`` and
before ``save_accelerator_state`` writes the new one in place; a hook can add files, not stage Accelerate's, mark
them done or stop that ``rmtree``. ``load_state()`` picks the highest ``checkpoint_N`` before any hook runs. So the
save and the load are the library's, and they take what ``save_state`` takes from the accelerator:

* the prepared models (the first under ``model`` with its optimizer under ``optim``, by parameter name, so
  ``pipeline.consolidate`` and ``pipeline.export`` read it; more models under ``model_K``, more optimizers under
  ``optim_K``), the schedulers (``sched``, ``sched_K``), the grad scaler, every object given to
  ``register_for_checkpointing`` (``custom_K``), ``accelerator.step``;
* each rank's RNG states, those Accelerate saves (Python's ``random``, NumPy's, torch's CPU and CUDA generators);
* each prepared dataloader's epoch (``iteration``) and, for a stateful one (``use_stateful_dataloader=True``), its
  position. With a plain loader the position is the step :func:`load_state` returns: skip that epoch's first
  batches with ``accelerator.skip_first_batches`` (``examples/accelerate_train.py``).

``ProjectConfiguration`` is honoured: the steps live in ``project_dir/checkpoints`` (``step_N``, the library's
layout), ``total_limit=N`` is the committer's ``keep_last=N`` (a step is removed only after a newer one is
committed), and with ``automatic_checkpoint_naming`` a :func:`save_state` without a step numbers it as Accelerate
counts its saves (``iteration`` + 1: step 1 is Accelerate's ``checkpoint_0``); a save or a load sets ``iteration`` to
its step, so the numbering goes on after a resume.

DDP or one process (``torchrun``, gloo or NCCL); FSDP, DeepSpeed, Megatron-LM and XLA are
refused in one line.
"""

from __future__ import annotations

import logging
import random
import sys
import weakref
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pipeline.checkpoint.checkpointer import Checkpointer
from pipeline.checkpoint.save.rank_save import SaveResult
from pipeline.checkpoint.save.state import MODEL, OPTIM, RankLocal
from pipeline.errors import ConfigError, need

need("accelerate", "accelerate", "pipeline.integrations.accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

log = logging.getLogger(__name__)

ACCELERATOR, RNG = "accelerator", "rng"
"""The step's keys besides ``model``/``optim``/``sched``/``data_K``/``custom_K``: ``accelerator.step``, and each
rank's generators (under ``rank_K``)."""
_REFUSED = {DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA}
_OPEN: weakref.WeakKeyDictionary[Accelerator, tuple[Checkpointer, dict[str, Any]]] = weakref.WeakKeyDictionary()


def checkpointer(accelerator: Accelerator, options: dict[str, Any] | None = None) -> Checkpointer:
    """The :class:`~pipeline.checkpoint.Checkpointer` of ``accelerator``'s run, opened at the first call (a
    collective: every rank calls it, as the first :func:`save_state` / :func:`load_state` does). ``options`` go to
    the checkpointer (``deadline_s``, ``storage="s3://..."``, ``keep_best``...); ``total_limit`` is ``keep_last``."""
    opened = _OPEN.get(accelerator)
    if opened is not None:
        if options is not None and options != opened[1]:
            raise ConfigError(
                f"the checkpointer of {accelerator.project_dir} is open with {opened[1]!r}: pass checkpointer= "
                "options at the first save_state/load_state only (or call close(accelerator) first)"
            )
        return opened[0]
    kind = accelerator.distributed_type
    if kind in _REFUSED:
        raise ConfigError(
            f"pipeline.integrations.accelerate: {kind.value} writes checkpoints in its own per-rank layout, not "
            "supported yet; use DDP (torchrun) or one process, or the library's Checkpointer"
        )
    config = accelerator.project_configuration
    if config.project_dir is None:
        raise ConfigError(
            "pipeline.integrations.accelerate: the Accelerator has no project_dir: pass project_config="
            "ProjectConfiguration(project_dir='runs/my-run', ...) (the steps go in <project_dir>/checkpoints)"
        )
    given = dict(options or {})
    keep = {"keep_last": config.total_limit} if config.total_limit is not None else {}
    ck = Checkpointer(config.project_dir, **{**keep, **given})
    _OPEN[accelerator] = (ck, given)
    if accelerator._save_model_state_pre_hook or accelerator._load_model_state_pre_hook:
        log.warning(
            "the Accelerator's save/load state pre-hooks are not called: they write files into Accelerate's own "
            "checkpoint dir; register the objects with accelerator.register_for_checkpointing instead"
        )
    return ck


def save_state(
    accelerator: Accelerator,
    step: int | None = None,
    *,
    metrics: dict[str, Any] | None = None,
    checkpointer: dict[str, Any] | None = None,
) -> SaveResult:
    """``accelerator.save_state()``, committed: every rank stages its part of ``step`` (the models, optimizers,
    schedulers, scaler, registered objects, its RNG states and loader positions) and its done-marker; the committer
    (rank 0's thread) verifies and publishes ``<project_dir>/checkpoints/step_N``, then moves ``latest``, then keeps
    the newest ``total_limit``. Every rank calls it at the same step. ``step`` None: with
    ``automatic_checkpoint_naming``, Accelerate's ``iteration`` + 1 (its save count), which then becomes the step
    saved. ``metrics`` (name -> number) go into the step's
    manifest (for ``keep_best``, ``status``). Returns how the save went; a failed one is never committed."""
    config = accelerator.project_configuration
    if step is None:
        if not config.automatic_checkpoint_naming:
            raise ConfigError(
                "save_state(accelerator): pass the step (save_state(accelerator, step)), or set "
                "ProjectConfiguration(automatic_checkpoint_naming=True) to number the steps by the saves"
            )
        step = config.iteration + 1
    ck = _checkpointer(accelerator, checkpointer)
    result = ck.save(step, _state(accelerator), metrics)
    if not result.ok:
        log.warning("step %d was not saved (%s): it is not committed; training goes on", step, result.error)
    config.iteration = step if config.automatic_checkpoint_naming else config.iteration + 1
    return result


def load_state(
    accelerator: Accelerator, step: int | str = "latest", *, checkpointer: dict[str, Any] | None = None
) -> int:
    """``accelerator.load_state()``, from a committed step: ``"latest"`` (the newest; rank 0 first commits every
    completely staged step), ``"best"`` or a step number. Rank 0 decides the step and verifies it against its
    manifest, every rank loads it (a collective). Returns the step loaded, 0 when none is committed (then nothing
    is changed: train from scratch). Sets ``accelerator.step`` and the automatic naming's ``iteration``."""
    ck = _checkpointer(accelerator, checkpointer)
    into = _state(accelerator)
    loaded = ck.load(into, step=step)
    if loaded:
        accelerator.step = int(into[ACCELERATOR]["step"])
        accelerator.project_configuration.iteration = loaded
    if ck.rank == 0:  # on the console whatever the logging set-up: which step a relaunch resumed from
        where = ck.layout.committed_step(loaded)
        said = f"resuming from committed step {loaded} ({where})" if loaded else f"no committed step in {where.parent}"
        print(f"pipeline.integrations.accelerate: {said}", file=sys.stderr, flush=True)
    return loaded


def close(accelerator: Accelerator) -> None:
    """Settle the saves of ``accelerator``'s run: every staged step committed (bounded by ``deadline_s``), then the
    checkpointer closed (a collective). A later :func:`save_state` opens a new one."""
    opened = _OPEN.pop(accelerator, None)
    if opened is not None:
        opened[0].close()


_checkpointer = checkpointer  # the public name is shadowed by the functions' ``checkpointer=`` option


# -- the state ---------------------------------------------------------------------------------------------------


def _state(accelerator: Accelerator) -> dict[str, Any]:
    """What ``accelerator.save_state`` saves, as the library's state (module doc)."""
    rank = accelerator.process_index
    models = list(accelerator._models)
    state: dict[str, Any] = {}
    if models:
        state[MODEL] = models[0]
    for k, model in enumerate(models[1:], start=1):
        state[f"model_{k}"] = _Model(model)
    paired = False
    for k, wrapped in enumerate(accelerator._optimizers):
        opt = getattr(wrapped, "optimizer", wrapped)  # AcceleratedOptimizer: the torch optimizer inside
        owner = _owner(models, opt)
        if owner == 0 and not paired:
            state[OPTIM], paired = opt, True
        else:
            state[f"optim_{k}"] = _Optimizer(models[owner], opt)
    for k, sched in enumerate(accelerator._schedulers):
        state["sched" if k == 0 else f"sched_{k}"] = sched
    for k, loader in enumerate(accelerator._dataloaders):
        state[f"data_{k}"] = RankLocal(_Loader(loader), rank)
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    for k, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{k}"] = obj
    state[ACCELERATOR] = {"step": int(accelerator.step)}
    state[RNG] = RankLocal(_RNG(), rank)
    return state


def _owner(models: list[Any], opt: torch.optim.Optimizer) -> int:
    """The index of the prepared model whose parameters ``opt`` steps (its state is saved by their names)."""
    params = {id(p) for group in opt.param_groups for p in group["params"]}
    for k, model in enumerate(models):
        if params and params <= {id(p) for p in model.parameters()}:
            return k
    raise ConfigError(
        f"an optimizer ({type(opt).__name__}) steps parameters of no single prepared model: prepare the model its "
        "parameters belong to with accelerator.prepare (its state is saved by parameter name)"
    )


class _Model:
    """A prepared model besides the first, by parameter name (DDP's ``module.`` prefix stripped)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd)


class _Optimizer:
    """An optimizer besides the first model's, keyed by its model's parameter names."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        return dict(get_optimizer_state_dict(self.model, self.opt))

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.opt, sd)  # type: ignore[arg-type]


class _Loader:
    """A prepared dataloader's epoch (Accelerate's ``iteration``, which seeds a seedable sampler) and, when it is
    stateful, its position in the epoch."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"iteration": int(getattr(self.loader, "iteration", 0))}
        if getattr(self.loader, "use_stateful_dataloader", False):
            out["position"] = self.loader.state_dict()
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(int(sd["iteration"]))
        if "position" in sd and getattr(self.loader, "use_stateful_dataloader", False):
            self.loader.load_state_dict(sd["position"])


class _RNG:
    """The generators Accelerate's ``rng_state_<rank>.pkl`` holds, as tensors and plain values."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = cast(tuple[str, Any, int, int, float], np.random.get_state(legacy=True))
        out: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)},
            "torch": torch.get_rng_state(),
        }  # fmt: skip
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        py = sd["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        n = sd["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state((str(n["kind"]), keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached"])))
        torch.set_rng_state(sd["torch"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(sd["cuda"]))
