"""What the library's ``Checkpointer`` and the app's train stage share around a fast restore: the durable tier's
floor (the step a fast copy must reach to be used) and the record of how a launch resumed."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from pipeline.checkpoint.fast import RESUMED_FILE
from pipeline.checkpoint.fast.landing import Landing
from pipeline.checkpoint.fast.restore import restore
from pipeline.checkpoint.fast.tier import FastConfig, FastTier
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.checkpoint.stores.stores import uncommitted
from pipeline.errors import PipelineError, ReadFailed
from pipeline.storage.atomic import write_json_atomic
from pipeline.storage.reads import failed, is_transient

log = logging.getLogger(__name__)


def durable_floor(store: CheckpointStore, world_size: int) -> int:
    """Rank 0: the durable tier's newest step (committed, or staged with every marker), read without verifying
    it: a fast copy at least this new is restored instead (the durable step is verified only when used)."""
    try:
        named = store.latest_named() or 0
    except ReadFailed:
        raise  # unknown: a lower floor would restore a fast copy older than the durable step
    except (PipelineError, OSError) as e:
        if is_transient(e):
            raise failed(e, "latest pointer", store.latest_where()) from e
        named = 0
    return max([named, *uncommitted(store, world_size)])


def record_resume(
    checkpoints: Path,
    fast_rec: dict[str, Any] | None,
    step: int,
    attempt: str,
    cfg: FastConfig | None,
    same_node: bool = False,
) -> dict[str, Any]:
    """Rank 0: write ``checkpoints/resumed.json`` (the tier, the step, each rank's source) and return it.
    ``same_node``: rank 0's replicas are on its own node (one node: they do not survive its loss)."""
    rec = dict(fast_rec or {"tier": "durable"})
    if rec.get("tier") != "fast":
        rec.update(tier="durable" if step else "none", step=step)
    rec.update(attempt=attempt, at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if cfg is not None:
        rec["fast"] = dataclasses.asdict(cfg) | {"same_node": same_node}
    try:
        write_json_atomic(checkpoints / RESUMED_FILE, rec)
    except OSError as e:
        log.warning("could not record the resume in %s: %s", checkpoints / RESUMED_FILE, e)
    return rec


class FastResume:
    """The ``first``/``floor`` pair :meth:`~pipeline.checkpoint.save.session.CheckpointSession.load_latest` takes,
    the check once the step is decided (:meth:`settled`), and the record rank 0 writes once it is loaded."""

    def __init__(self, tier: FastTier, store: CheckpointStore, checkpoints: Path, landing: Landing):
        self.tier, self.store, self.checkpoints, self.landing = tier, store, checkpoints, landing
        self.rec: dict[str, Any] | None = None

    def floor(self) -> int:
        return durable_floor(self.store, self.tier.world)

    def first(self, floor: int) -> int | None:
        return restore(self.tier, floor, self.landing, self._note)

    def _note(self, rec: dict[str, Any]) -> None:
        self.rec = rec

    def settled(self, step: int) -> None:
        """Every rank, with the step the resume loaded: a fresh start after received bytes went into the state is
        refused (:meth:`Landing.check_fresh`)."""
        self.landing.check_fresh(step, self.tier.group)

    def record(self, step: int) -> dict[str, Any]:
        """Rank 0: ``checkpoints/resumed.json``."""
        same_node = bool(self.tier.same_node)
        return record_resume(self.checkpoints, self.rec, step, self.tier.attempt, self.tier.cfg, same_node)
