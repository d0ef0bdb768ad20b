"""The read side of the :class:`~pipeline.checkpoint.Checkpointer`: which committed steps there are, the best
one, and loading any of them (the newest first from the fast tier, when it has one at least as new)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import resume, steps
from pipeline.checkpoint.fast.landing import Landing
from pipeline.checkpoint.fast.resuming import FastResume
from pipeline.checkpoint.fast.tier import FastTier
from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.save import deepspeed_engine
from pipeline.checkpoint.save.background import BackgroundCommitter
from pipeline.checkpoint.save.session import CheckpointSession
from pipeline.checkpoint.save.state import OPTIM, apply_state, load_state, save_state
from pipeline.checkpoint.stores.remote import Remote
from pipeline.checkpoint.stores.stores import store_for
from pipeline.errors import ConfigError, PipelineError
from pipeline.storage.layout import CheckpointLayout

log = logging.getLogger(__name__)


class Loading:
    """:meth:`steps`, :meth:`latest_step`, :meth:`best_step`, :meth:`load`, :meth:`load_latest`."""

    layout: CheckpointLayout
    remote: Remote | None
    session: CheckpointSession
    rank: int
    world_size: int
    group: Any
    deadline_s: float
    fast: FastTier | None
    resumed: dict[str, Any] | None
    _keep: dict[str, Any]
    _committer: BackgroundCommitter | None
    _last_save: float

    def _check_open(self) -> None:
        raise NotImplementedError

    def steps(self) -> list[int]:
        """Every committed step, oldest first (read from the store; any rank may call it)."""
        return steps.committed_steps(store_for(self.layout, self.remote))

    def latest_step(self) -> int | None:
        """The newest committed step, or None (read from the store; any rank may call it)."""
        newest = store_for(self.layout, self.remote).newest()
        return newest.step if newest is not None else None

    def best_step(self) -> int | None:
        """The committed step whose recorded ``best_metric`` is best by ``best_mode`` (ties: the newer), or None
        when no step recorded it (any rank may call it)."""
        return steps.best_of(store_for(self.layout, self.remote), self._keep["best_metric"], self._keep["best_mode"])

    def load(
        self,
        into: dict[str, Any],
        step: int | str = "latest",
        *,
        exclude: str | tuple[str, ...] = (),
        partial: bool = False,
    ) -> int:
        """Load committed ``step`` into ``into`` and return it: a step number, ``"best"`` (:meth:`best_step`) or
        ``"latest"`` (:meth:`load_latest`; 0 when there is none). A collective: rank 0 picks the step and verifies
        it against its manifest, every rank loads it. ``exclude``: top-level keys of ``into`` left as they are;
        ``partial``: values the step does not hold (a key the state gained since) keep theirs, named in a
        WARNING (without it such a load fails in one line naming them). Loading an older step to train on from
        it: save into a new directory (the steps after it are committed here already)."""
        if step == steps.LATEST:
            return self.load_latest(into, exclude=exclude, partial=partial)
        self._check_open()
        exclude = _excluded(into, exclude)
        store = store_for(self.layout, self.remote)

        def decide() -> int | str:
            try:
                chosen = steps.pick(store, step, self._keep["best_metric"], self._keep["best_mode"])
                steps.verified_dir(store, chosen)
            except (PipelineError, OSError) as e:
                return f"cannot load step {step!r}: {' '.join(str(e).split())}"
            return chosen

        loaded = self.session.load_latest(decide, self._loader(into, exclude, partial))
        if self.rank == 0:
            log.info("loaded step %d of %s (committed, verified against its manifest)", loaded, store.where)
        return loaded

    def _loader(self, into: dict[str, Any], exclude: tuple[str, ...], partial: bool) -> Callable[[Path, Manifest], int]:
        engine_key = deepspeed_engine.find_engine(into)
        rest = {k: v for k, v in into.items() if k != engine_key}

        def load(step_dir: Path, manifest: Manifest) -> int:
            if engine_key is not None and engine_key not in exclude:
                deepspeed_engine.load_engine(into[engine_key], step_dir, manifest)
            same_world = manifest.world_size == self.world_size
            loaded = load_state(
                rest, step_dir, self.group, self.rank, same_world=same_world, exclude=tuple(exclude), partial=partial
            )
            into.update(rest)
            return loaded

        return load

    def load_latest(self, into: dict[str, Any], *, exclude: str | tuple[str, ...] = (), partial: bool = False) -> int:
        """Load the newest committed step into ``into`` (same keys as saved; ``exclude`` and ``partial`` as for
        :meth:`load`) and return it; 0 when there is none. Rank 0 first lets every completely staged step be
        committed (a step saved before a kill is never lost nor trained again), verifies the step against its
        manifest, and hands its choice to every rank."""
        self._check_open()
        engine_key = deepspeed_engine.find_engine(into)
        exclude = _excluded(into, exclude)
        rest = {k: v for k, v in into.items() if k != engine_key and k not in exclude}
        load = self._loader(into, exclude, partial)

        fast, store = None, store_for(self.layout, self.remote)
        if self.fast is not None and engine_key is None:
            fast = FastResume(self.fast, store, self.layout.checkpoints, self._landing(into, rest))
        first, floor = (fast.first, fast.floor) if fast is not None else (None, None)
        step = self.session.load_latest(self._resume_step, load, first=first, floor=floor)
        if fast is not None:
            fast.settled(step)
        if fast is not None and self.rank == 0:
            self.resumed = fast.record(step)
        if self.rank == 0 and (self.resumed or {}).get("tier") != "fast":  # the fast tier logs its own line
            resume.log_resumed(store, step)
        self._last_save = time.monotonic()
        return step

    def _landing(self, into: dict[str, Any], rest: dict[str, Any]) -> Landing:
        def apply(target: dict[str, Any]) -> int:
            loaded = apply_state(rest, target)
            into.update(rest)
            return loaded

        opt = rest.get(OPTIM)
        opt = opt if isinstance(opt, torch.optim.Optimizer) else None
        return Landing(lambda: save_state(rest, 0, self.rank), apply, f"rank {self.rank}'s fast copy", opt)

    def _resume_step(self) -> int | str:
        if self._committer is not None and not self._committer.recovered.wait(self.deadline_s):
            errors = "; ".join(self._committer.errors[-3:]) or "no error reported"
            return f"cannot resume: the committer's first pass over {self.layout.checkpoints} did not finish ({errors})"
        alive = self._committer.alive if self._committer is not None else None
        return resume.decide_with(self.layout, self.world_size, self.deadline_s, alive, self.remote)


def _excluded(into: dict[str, Any], exclude: Any) -> tuple[str, ...]:
    """``exclude`` as a tuple of ``into``'s top-level keys: one key given as a string is that key (not its
    letters); a key ``into`` does not have is one line naming the keys it has (a typo would load everything)."""
    keys = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    unknown = [k for k in keys if k not in into]
    if unknown:
        raise ConfigError(f"exclude={list(keys)!r}: the state has no key {unknown[0]!r} (its keys: {', '.join(into)})")
    return keys
