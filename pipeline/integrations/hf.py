"""The Hugging Face ``Trainer`` on the commit protocol: :class:`CommittedTrainer`, a drop-in for ``Trainer``.

    from pipeline.integrations.hf import CommittedTrainer

    trainer = CommittedTrainer(model=model, args=args, train_dataset=ds)  # was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)  # the newest *committed* step, or from scratch

What changes against ``Trainer``:

* **Saves are staged and committed.** At every save (``save_steps``, ``save_strategy``) each rank writes its part
  of the checkpoint (the files ``Trainer`` writes: the model, ``optimizer.pt``, ``scheduler.pt``,
  ``trainer_state.json``, its ``rng_state_<rank>.pth``) into a staged step, hashes it and writes its done-marker;
  one committer (rank 0's thread) verifies every file and publishes ``<output_dir>/checkpoints/step_N``, then
  moves ``latest``. A ``checkpoint-N`` directory a kill left half-written no longer exists to be picked.
* **Resume takes a committed step.** ``resume_from_checkpoint=True`` resumes from the newest committed step
  (rank 0 first commits what was completely staged, verifies the step and hands the choice to every rank), or
  trains from scratch when none is committed (``Trainer`` would raise); the RNG states and the data position are
  ``Trainer``'s own, restored from that step as ``Trainer`` restores them.
* **Rotation is the committer's.** ``save_total_limit=N`` keeps the newest N committed steps; with
  ``metric_for_best_model`` the best step is kept too (``keep_best=1``, ranked by that metric, its direction
  ``greater_is_better``); ``Trainer``'s own ``rmtree`` rotation never runs. ``load_best_model_at_end`` loads the
  best committed step once every step is committed.
* ``python -m pipeline.status <output_dir> --verify``, ``pipeline.consolidate`` and ``pipeline.export`` read the
  steps (format ``hf_trainer``).

DDP or one process (``torchrun``, gloo or NCCL); FSDP and DeepSpeed under ``Trainer`` are refused in one line
(their checkpoint files are written by every rank in their own layouts). One ``train()`` per trainer: the
checkpointer is closed when it returns (every staged step committed first).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, cast

from pipeline.checkpoint.checkpointer import Checkpointer
from pipeline.errors import ConfigError, need
from pipeline.formats.registry import FORMATS, HF_TRAINER
from pipeline.storage.atomic import is_temp_name
from pipeline.storage.integrity import FileEntry, describe, lstat_kind

need("transformers", "hf", "pipeline.integrations.hf")
from transformers import Trainer  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402

log = logging.getLogger(__name__)
_EVAL = re.compile(r"^eval_")


class CommittedTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints are committed (module doc). Every argument is ``Trainer``'s;
    ``checkpointer`` passes options to the :class:`~pipeline.checkpoint.Checkpointer` (e.g. ``deadline_s``,
    ``storage="s3://bucket/prefix"``); retention comes from ``args`` (``save_total_limit``,
    ``metric_for_best_model``, ``greater_is_better``)."""

    def __init__(self, *args: Any, checkpointer: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise ConfigError(
                "CommittedTrainer: FSDP and DeepSpeed under Trainer write checkpoints in their own per-rank layouts, "
                "not supported yet; use DDP (torchrun) or one process, or the library's Checkpointer in your own loop"
            )
        a = self.args
        metric = a.metric_for_best_model
        keep_best = 1 if metric else None
        options: dict[str, Any] = {
            "keep_last": a.save_total_limit,
            "keep_best": keep_best,
            "best_metric": _metric_key(metric) if metric else "loss",
            "best_mode": "max" if a.greater_is_better else "min",
            **(checkpointer or {}),
        }
        self.checkpointer = Checkpointer(str(a.output_dir), **options)
        self._best_metric: str = options["best_metric"]
        self.committed_resume: int | None = None
        """The step ``train`` resumed from (0: none committed, from scratch), once it was called."""

    # -- saving ------------------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """``Trainer``'s save, staged: this rank's files of the step, its marker; the committer does the rest."""
        step = self.state.global_step
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        rank = self.checkpointer.rank

        def write(staged: Path) -> tuple[FileEntry, ...]:
            out = str(staged)
            self.save_model(out, _internal_call=True)
            if not self.args.save_only_model:
                self._save_optimizer_and_scheduler(out)
                self._save_scaler(out)
            self._save_rng_state(out)  # always: each rank's file says which ranks wrote the step
            if self.args.should_save:
                for cb in [
                    c for c in [*self.callback_handler.callbacks, self.control] if isinstance(c, ExportableState)
                ]:
                    saved = cast(dict[str, Any], self.state.stateful_callbacks)  # TrainerState made it a dict
                    name, cb_state = cb.__class__.__name__, cb.state()
                    if isinstance(saved.get(name), list):
                        saved[name].append(cb_state)
                    else:
                        saved[name] = cb_state
                self.state.save_to_json(os.path.join(out, "trainer_state.json"))
            return own_files(staged, rank)

        result = self.checkpointer.save_files(step, HF_TRAINER, write, self._save_metrics())
        if not result.ok:
            log.warning("step %d was not saved (%s): it is not committed; training goes on", step, result.error)

    def _save_metrics(self) -> dict[str, float]:
        """The metric best-k ranks by, from the newest evaluation at this step (every rank has the same)."""
        key = self._best_metric
        for entry in reversed(self.state.log_history):
            if entry.get("step") != self.state.global_step:
                break
            for name in (key, f"eval_{key}"):
                if isinstance(entry.get(name), (int, float)):
                    return {key: float(entry[name])}
        return {}

    # -- resuming ----------------------------------------------------------------------------------------------

    def committed_checkpoint(self) -> str | None:
        """The newest committed step's directory, verified, the same on every rank (a collective); None when no
        step is committed. Rank 0 first commits every completely staged step."""
        ck = self.checkpointer
        step = ck.session.load_latest(ck._resume_step, lambda _dir, manifest: manifest.step)
        self.committed_resume = step
        where = ck.layout.committed_step(step)
        if ck.rank == 0:  # on the console whatever the logging set-up: which step a relaunch resumed from
            said = f"resuming from committed step {step} ({where})" if step else f"no committed step in {where.parent}"
            print(f"CommittedTrainer: {said}", file=sys.stderr, flush=True)
        return str(where) if step else None

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any
    ) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` means the newest committed step (none: from scratch).
        Closes the checkpointer when it returns: every staged step is committed, then the best one loaded if
        ``load_best_model_at_end``."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self.committed_checkpoint()
        load_best, self.args.load_best_model_at_end = self.args.load_best_model_at_end, False
        try:
            out = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            self.args.load_best_model_at_end = load_best
            self.checkpointer.close()
        if load_best:
            best = self.checkpointer.best_step()
            if best is not None:
                self.state.best_model_checkpoint = str(self.checkpointer.layout.committed_step(best))
                self._load_from_checkpoint(self.state.best_model_checkpoint)
        return out


def own_files(staged: Path, rank: int) -> tuple[FileEntry, ...]:
    """This rank's files of a staged ``Trainer`` step (by the ``hf_trainer`` format's owner rule), hashed. Another
    rank's files, the markers and temporary files are never listed, whatever state they are in."""
    owner = FORMATS[HF_TRAINER].owner
    entries = []
    for path in sorted(p for p in staged.rglob("*") if lstat_kind(p) == "file"):  # a link is never listed
        rel = path.relative_to(staged).as_posix()
        if is_temp_name(path.name) or owner(rel) != rank:
            continue
        entries.append(describe(staged, rel))
    return tuple(entries)


def _metric_key(metric: str) -> str:
    """``metric_for_best_model`` as ``Trainer`` logs it (``eval_`` prefixed), the name the steps record."""
    return metric if _EVAL.match(metric) else f"eval_{metric}"
