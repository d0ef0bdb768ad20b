"""PyTorch Lightning on the commit protocol: :class:`CommittedCheckpoint`, a drop-in for ``ModelCheckpoint``.

    from pipeline.integrations.lightning import CommittedCheckpoint as ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath="runs/lit", every_n_train_steps=100, save_top_k=3, monitor="val_loss")
    trainer = Trainer(callbacks=[ckpt], strategy="ddp")
    trainer.fit(model, data, ckpt_path="last")  # the newest *committed* step ("best": the best one), or fresh

Why a ``ModelCheckpoint`` subclass: it is where a Lightning user already says when to save (``every_n_train_steps``,
``every_n_epochs``, ``train_time_interval``) and what to keep (``save_top_k``, ``monitor``, ``mode``), and it is
the callback ``ckpt_path="last"`` / ``"best"`` are resolved through (``_find_last_checkpoints``,
``best_model_path``). Its save hook runs on every rank, so every rank stages its part of the step. A
``CheckpointIO`` alone could not: Lightning calls it on rank 0 only, with a file path, and ``ModelParallelStrategy``
does not call it at all. For the load, ``setup`` wraps the strategy's ``load_checkpoint`` (every strategy loads
there, on every rank, once the process group exists): a path naming committed steps goes to the library, where
rank 0 decides the step; any other path to the strategy's own.

What changes against ``ModelCheckpoint``:

* **Saves are staged and committed.** At each save every rank stages the step through the library's
  :class:`~pipeline.checkpoint.Checkpointer`: the ``LightningModule``'s weights under ``model`` (DCP, so
  ``pipeline.consolidate`` and ``pipeline.export`` read them), the optimizers' states, and the rest of the
  checkpoint dict Lightning builds (loops, callbacks, schedulers, a stateful loader's position), each rank its own.
  Under ``ModelParallelStrategy`` (FSDP2's ``fully_shard`` and tensor parallel in ``configure_model``) the weights
  and the optimizer's state are saved sharded, each rank its own shards (DCP), and loaded back in place.
  One committer (rank 0's thread) verifies and publishes ``<dirpath>/checkpoints/step_N``, then moves ``latest``.
* **Resume takes a committed step.** ``ckpt_path="last"`` is the newest committed step, ``"best"`` the best by
  ``monitor``, a ``.../checkpoints/step_N`` path that step: rank 0 commits what was completely staged, verifies the
  step, and every rank loads what it decided. Nothing committed: training starts from scratch (a line says so).
* **Retention is the committer's.** ``save_top_k=k`` keeps the newest k steps (no ``monitor``) or the best k by
  ``monitor`` / ``mode`` and ``latest``'s step (with one); ``-1`` keeps all. Lightning's ``_remove_checkpoint``
  never runs. ``best_model_path`` names the best committed step.
* **Async.** With Lightning's ``AsyncCheckpointIO`` plugin, saves go through the library's ``save_async`` (a copy,
  then written, marked and committed in the background): the commit is never bypassed.

DDP, ``ModelParallelStrategy`` (one optimizer) or one device (gloo or NCCL); ``FSDPStrategy`` (FSDP1: Lightning
runs it on CUDA only, so it is untested here) and DeepSpeed are refused in one line. A resume takes the world size
the step was saved at. ``trainer.save_checkpoint(path)`` still writes a plain file of
the user's own (outside the protocol).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.checkpoint import steps
from pipeline.checkpoint.checkpointer import Checkpointer
from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.save.state import OPTIM
from pipeline.checkpoint.stores.stores import store_for
from pipeline.errors import ConfigError, PipelineError, need
from pipeline.integrations.lightning_state import decode, encode
from pipeline.storage.layout import CheckpointLayout

need("pytorch_lightning", "lightning", "pipeline.integrations.lightning")
import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.plugins.io import AsyncCheckpointIO  # noqa: E402
from pytorch_lightning.strategies import (  # noqa: E402
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)

log = logging.getLogger(__name__)

MODEL, OPTIMIZERS, LIGHTNING = "model", "optimizers", "lightning"
"""The step's keys: the module's weights, the optimizers' states (the same on every DDP rank, stored once; under a
sharded strategy the one optimizer's, sharded, under the library's ``optim``), and the rest of each rank's
Lightning checkpoint dict (under ``rank_K``)."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CommittedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose saves are committed by the library (module doc). Every argument is
    ``ModelCheckpoint``'s, ``dirpath`` required (the run's directory: a relaunch finds its steps there);
    ``checkpointer`` passes options to the :class:`~pipeline.checkpoint.Checkpointer` (``deadline_s``,
    ``storage="s3://bucket/prefix"``, ...)."""

    def __init__(self, *args: Any, checkpointer: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.dirpath is None:
            raise ConfigError(
                "CommittedCheckpoint: pass dirpath= (the run's directory): a relaunch with ckpt_path='last' finds "
                "its committed steps there, before Lightning has a logger's version directory"
            )
        if self.save_last == "link":
            raise ConfigError("CommittedCheckpoint: save_last='link' links files; use save_last=True (or None)")
        self._options = {**self._retention(), **(checkpointer or {})}
        self._root = Path(self.dirpath).resolve()
        self.checkpointer: Checkpointer | None = None
        """The library's checkpointer, open from ``setup`` to ``teardown``."""
        self.committed_resume: int | None = None
        """The committed step the last load restored (0: none was committed, training started fresh)."""
        self._routed: Strategy | None = None
        self._async = False
        self._sharded = False
        self._trainer: pl.Trainer | None = None

    def _retention(self) -> dict[str, Any]:
        """``save_top_k`` / ``monitor`` / ``mode`` as the committer's retention."""
        k = self.save_top_k
        if k == -1:
            return {}
        if self.monitor is None or k == 0 or (self.monitor == "step" and self.mode == "max"):
            return {"keep_last": max(k, 1)}  # monitor="step", mode="max": Lightning's way to say the newest k
        return {"keep_last": 1, "keep_best": k, "best_metric": self.monitor, "best_mode": self.mode}

    # -- where the steps are -----------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> Path:
        """``<dirpath>/checkpoints``: the committed steps, ``latest``, staging and quarantine."""
        return self._root / "checkpoints"

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """``ckpt_path="last"``: the checkpoints directory, always (every rank answers alike before the process
        group exists); which step it means is decided at the load, by rank 0."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)  # planned dir, idempotent
        return {str(self.checkpoints)}

    @property  # type: ignore[override]
    def best_model_path(self) -> str:
        """The best committed step's directory (by ``monitor`` / ``mode``); before any is committed, the token
        ``ckpt_path="best"`` resolves to (the load decides). Empty without ``monitor``, as in Lightning."""
        if self.monitor is None:
            return ""
        ck = self.checkpointer
        store = store_for(ck.layout, ck.remote) if ck is not None else store_for(CheckpointLayout(self._root), None)
        best = steps.best_of(store, self.monitor, self.mode)
        return str(self.checkpoints / f"step_{best}") if best else str(self.checkpoints / steps.BEST)

    @best_model_path.setter
    def best_model_path(self, _value: str) -> None:
        """Lightning's own bookkeeping assigns it; the committed steps decide what it reads."""

    def which(self, path: str | Path) -> int | str | None:
        """What a ``ckpt_path`` names: ``"latest"``, ``"best"``, a step number, or None (a file of the user's)."""
        p = Path(path).resolve()
        if p == self.checkpoints:
            return steps.LATEST
        if p.parent == self.checkpoints:
            if p.name == steps.BEST:
                return steps.BEST
            m = _STEP_DIR.match(p.name)
            if m:
                return int(m.group(1))
        return None

    # -- set-up and end ----------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        strategy = trainer.strategy
        if isinstance(strategy, FSDPStrategy):
            raise ConfigError(
                "CommittedCheckpoint: FSDPStrategy (FSDP1) is not supported (Lightning runs it on CUDA only, so it is "
                "untested); use strategy=ModelParallelStrategy() with fully_shard (FSDP2) in configure_model"
            )
        supported = DDPStrategy | SingleDeviceStrategy | ModelParallelStrategy
        if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, supported):
            raise ConfigError(
                f"CommittedCheckpoint: {type(strategy).__name__} writes checkpoints in its own per-rank layout, not "
                "supported yet; use strategy='ddp', ModelParallelStrategy (FSDP2) or one device, or the library's "
                "Checkpointer in your own loop"
            )
        self._trainer = trainer
        self._sharded = isinstance(strategy, ModelParallelStrategy)
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self._root, **self._options)  # a collective: the group exists now
        if self._routed is None:
            self._async = isinstance(strategy.checkpoint_io, AsyncCheckpointIO)
            self._route_loads(strategy)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Every staged step committed (bounded by ``deadline_s``), then the checkpointer closed."""
        super().teardown(trainer, pl_module, stage)
        if self._routed is not None:
            vars(self._routed).pop("load_checkpoint", None)  # the strategy's own method again
            self._routed = None
        if self.checkpointer is not None:
            ck, self.checkpointer = self.checkpointer, None
            ck.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A failing fit: no collective (another rank may be gone); the committer still commits what is complete."""
        if self.checkpointer is not None:
            ck, self.checkpointer = self.checkpointer, None
            ck.__exit__(type(exception), exception, exception.__traceback__)

    # -- saving ------------------------------------------------------------------------------------------------

    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]) -> None:
        """Every save trigger stages the step; which steps stay is the committer's retention."""
        if self.save_top_k != 0:
            self._save_once(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]) -> None:
        if self.save_last:
            self._save_once(trainer, monitor_candidates)

    def _save_once(self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]) -> None:
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            value = monitor_candidates.get(self.monitor) if self.monitor else None
            self._commit(trainer, None if value is None else float(value))

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Lightning's other callers (``save_on_exception``): the step, staged like any other."""
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            self._commit(trainer, None)

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Never: the committer's retention removes steps, no rank ``rmtree``s one."""

    def _commit(self, trainer: pl.Trainer, score: float | None) -> None:
        """Stage ``trainer.global_step`` on every rank (its part and its marker); the committer does the rest."""
        ck = self.checkpointer
        if ck is None:
            raise PipelineError("CommittedCheckpoint: saving before setup() or after teardown()")
        step = trainer.global_step
        self._last_global_step_saved = step
        self._last_checkpoint_saved = str(self.checkpoints / f"step_{step}")
        self.last_model_path = self._last_checkpoint_saved
        optimizer = self._sharded_optimizer(trainer)
        with _without_sharded_states(trainer.strategy, self._sharded):
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only)
        checkpoint.pop("state_dict", None)  # the module's weights go under MODEL, by name
        optimizers = checkpoint.pop("optimizer_states", None)
        state: dict[str, Any] = {MODEL: trainer.lightning_module, LIGHTNING: {f"rank_{ck.rank}": encode(checkpoint)}}
        if optimizer is not None and not self.save_weights_only:
            state[OPTIM] = optimizer  # sharded, by parameter name, with the model's shards
        elif optimizers is not None and not self._sharded:
            state[OPTIMIZERS] = encode({"states": optimizers})
        metrics = {self.monitor: score} if self.monitor and score is not None else None
        if self._async:
            ck.save_async(step, state, metrics)
            return
        result = ck.save(step, state, metrics)
        if not result.ok:
            log.warning("step %d was not saved (%s): it is not committed; training goes on", step, result.error)

    def _sharded_optimizer(self, trainer: pl.Trainer) -> Any:
        """Under a sharded strategy its one optimizer (None without one); elsewhere None (Lightning's own states)."""
        if not self._sharded or not trainer.optimizers:
            return None
        if len(trainer.optimizers) > 1:
            raise ConfigError(
                f"CommittedCheckpoint: {len(trainer.optimizers)} optimizers under {type(trainer.strategy).__name__}; "
                "a sharded step holds one (by parameter name): use one optimizer, or strategy='ddp'"
            )
        return trainer.optimizers[0]

    # -- loading (every rank, from the strategy's load_checkpoint) ---------------------------------------------

    def _route_loads(self, strategy: Strategy) -> None:
        """The strategy's ``load_checkpoint`` (this instance's, until ``teardown``) sends a path naming committed
        steps to :meth:`load_committed` and any other to the method it wraps."""
        own = strategy.load_checkpoint

        def load_checkpoint(path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            which = self.which(path)
            return own(path, weights_only=weights_only) if which is None else self.load_committed(which)

        strategy.load_checkpoint = load_checkpoint  # type: ignore[method-assign,assignment]
        self._routed = strategy

    def load_committed(self, which: int | str) -> dict[str, Any]:
        """The Lightning checkpoint dict of the committed step ``which`` names, decided by rank 0 (a collective)."""
        ck, trainer = self.checkpointer, self._trainer
        if ck is None or trainer is None:
            raise PipelineError("CommittedCheckpoint: a committed step is loaded between setup() and teardown()")
        module = trainer.lightning_module
        into: dict[str, Any] = {MODEL: module, LIGHTNING: {}, OPTIMIZERS: {}}
        optimizer = self._sharded_optimizer(trainer)  # set up before the load under a sharded strategy
        if optimizer is not None:
            into = {MODEL: module, OPTIM: optimizer, LIGHTNING: {}}  # loaded in place, shard by shard

        def decide() -> int | str:
            newest = ck._resume_step()  # the committer's first pass: a completely staged step is committed first
            if isinstance(newest, str) or which == steps.LATEST or (not newest and which == steps.BEST):
                return newest
            try:
                chosen = steps.pick(store_for(ck.layout, ck.remote), which, self.monitor or "loss", self.mode)
                steps.verified_dir(store_for(ck.layout, ck.remote), chosen)
            except (PipelineError, OSError) as e:
                named = str(self.checkpoints / f"step_{which}") if isinstance(which, int) else which
                why = " ".join(str(e).split())
                fix = "pass 'last', 'best' or a committed step"
                return f"CommittedCheckpoint: cannot load ckpt_path {named!r}: {why}; {fix}"
            return chosen

        load = ck._loader(into, (), False)

        def load_checked(step_dir: Path, manifest: Manifest) -> int:
            if manifest.world_size != ck.world_size:
                raise ConfigError(
                    f"{step_dir} was saved by {manifest.world_size} ranks; Lightning's loop and callback state is "
                    f"per rank: resume with {manifest.world_size} ranks"
                )
            return load(step_dir, manifest)

        step = ck.session.load_latest(decide, load_checked)
        self.committed_resume = step
        if ck.rank == 0:  # on the console whatever the logging set-up: which step a relaunch resumed from
            where = ck.layout.committed_step(step)
            said = f"resuming from committed step {step} ({where})" if step else f"no committed step in {where.parent}"
            print(f"CommittedCheckpoint: {said}", file=sys.stderr, flush=True)
        if not step:  # nothing to restore: what Lightning restores from this leaves every state as it is
            return {"pytorch-lightning_version": pl.__version__, "state_dict": module.state_dict(),
                    "optimizer_states": [], "lr_schedulers": []}  # fmt: skip
        checkpoint: dict[str, Any] = decode(into[LIGHTNING][f"rank_{ck.rank}"])
        checkpoint["state_dict"] = module.state_dict()  # loaded in place by the library
        if into.get(OPTIMIZERS):  # DDP's: Lightning loads them (a sharded strategy's optimizer was loaded in place)
            checkpoint["optimizer_states"] = decode(into[OPTIMIZERS])["states"]
        return checkpoint


@contextmanager
def _without_sharded_states(strategy: Strategy, sharded: bool) -> Iterator[None]:
    """Under a sharded strategy, Lightning's checkpoint dict without the weights and optimizer states it would
    gather or copy to the CPU: the library saves those itself, each rank its shards. Elsewhere, nothing changes."""
    if not sharded:
        yield
        return
    strategy.lightning_module_state_dict = dict  # type: ignore[method-assign]
    strategy.optimizer_state = lambda optimizer: {}  # type: ignore[method-assign]
    try:
        yield
    finally:
        vars(strategy).pop("lightning_module_state_dict", None)
        vars(strategy).pop("optimizer_state", None)
