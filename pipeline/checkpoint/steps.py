"""Which committed step: the newest, the best by a recorded metric, or one by number.

One rule for the library (:meth:`Checkpointer.steps`, :meth:`~Checkpointer.best_step`, ``load(step=...)``) and the
command lines (``--step N`` / ``--best`` of ``status``, ``consolidate`` and ``export``). Only committed steps count
(a manifest, in a directory or a bucket); the one chosen is verified against its manifest before anyone reads it.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoint.manifest import verify_committed
from pipeline.checkpoint.protocol.retention import Best
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.errors import PipelineError

LATEST, BEST = "latest", "best"


def committed_steps(store: CheckpointStore) -> list[int]:
    """Every committed step, oldest first."""
    return sorted(store.committed())


def best_of(store: CheckpointStore, metric: str, mode: str) -> int | None:
    """The committed step whose recorded ``metric`` is best (``mode`` ``min``: lowest; ``max``: highest; ties: the
    newer step), as best-k retention ranks them; None when no step recorded it (a value that was not finite, saved
    as null, is never best)."""
    steps = committed_steps(store)
    scores = {s: v for s in steps if (v := store.step_metrics(s).get(metric)) is not None}
    if not scores:
        return None
    chosen = Best(1, metric, mode, scores).chosen(steps, max(steps))
    return next(iter(chosen)) if chosen else None


def pick(store: CheckpointStore, which: int | str, metric: str = "loss", mode: str = "min") -> int:
    """The committed step ``which`` names: ``"latest"``, ``"best"`` (by ``metric``/``mode``) or a step number;
    a :class:`PipelineError` naming the steps there are when there is no such step."""
    steps = committed_steps(store)
    shown = _steps_text(steps)
    if which == LATEST:
        newest = store.newest()
        if newest is None:
            raise PipelineError(f"no committed step in {store.where}")
        return newest.step
    if which == BEST:
        best = best_of(store, metric, mode)
        if best is None:
            raise PipelineError(
                f"no committed step in {store.where} recorded {metric!r} (committed: {shown}): pass it to "
                f"save(step, state, metrics={{{metric!r}: value}}), or choose a step by number"
            )
        return best
    if isinstance(which, bool) or not isinstance(which, int):
        raise PipelineError(f"step={which!r}: a step number, {LATEST!r} or {BEST!r}")
    if which not in steps:
        raise PipelineError(f"step {which} is not committed in {store.where} (committed: {shown})")
    return which


def verified_dir(store: CheckpointStore, step: int) -> Path:
    """A local directory holding committed ``step``, verified against its manifest (pulled from a bucket)."""
    step_dir = store.local(step).committed_step(step)
    verify_committed(step_dir, step)
    return step_dir


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 12 else f"{len(steps)} steps, {steps[0]} to {steps[-1]}"
