"""Closing a job whose steps an external committer commits (``Checkpointer(committer="external")``): rank 0 waits,
bounded, until ``python -m pipeline.commit <dir> --follow`` (or any committer holding the dir's lease) has committed
the steps this job saved, and names in a WARNING those still staged. Never raises for them: they stay staged for
the next committer.
"""

from __future__ import annotations

import logging
import time

from pipeline.checkpoint import stores
from pipeline.checkpoint.remote import Remote
from pipeline.checkpoint.store import CheckpointStore
from pipeline.errors import DeadlineError, PipelineError
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.waiting import wait_until

log = logging.getLogger("pipeline.checkpoint.checkpointer")
"""The Checkpointer's logger: these warnings are its ``close``'s."""


def uncommitted(store: CheckpointStore, world_size: int, saved: list[int]) -> list[int]:
    """The steps of ``saved`` that are staged with every marker but not committed (newer than ``latest``)."""
    return sorted(set(stores.uncommitted(store, world_size)) & set(saved))


def await_external_commit(
    layout: CheckpointLayout,
    remote: Remote | None,
    world_size: int,
    saved: list[int],
    deadline_s: float,
    wait_s: float,
) -> None:
    """Rank 0 with ``committer="external"``: wait until an external committer has committed the steps this job
    saved (``saved``), for ``wait_s`` while none holds the dir (a running one: up to ``deadline_s``).
    Steps still uncommitted are named in a WARNING; they stay staged for the next committer. Never raises
    for them."""
    store = stores.store_for(layout, remote)
    where = store.where
    last_seen: float | None = None  # monotonic time a committer was last seen running
    start = time.monotonic()

    def running() -> bool:
        nonlocal last_seen
        if stores.committer_running(store):
            last_seen = time.monotonic()
            return True
        return time.monotonic() - (last_seen if last_seen is not None else start) < wait_s

    errors: list[str] = []

    def left() -> list[int] | None:
        try:
            return uncommitted(store, world_size, saved)
        except (PipelineError, OSError) as e:  # a step moved while read, a bucket that did not answer
            errors.append(str(e))
            return None

    try:
        wait_until(
            lambda: True if left() == [] else None,
            deadline_s=deadline_s,
            what=str,
            alive=running,
            interval_s=store.poll_s,
        )
        return
    except DeadlineError:
        pass
    still = left()
    if still is None:
        log.warning("cannot tell whether the steps this job saved in %s were committed: %s", where, errors[-1])
        return
    if not still:
        return
    many = len(still) > 1
    steps = f"step{'s' if many else ''} {', '.join(map(str, still))}"
    start_one = f"python -m pipeline.commit {layout.run_dir}"
    if last_seen is None:
        why = f"no committer ran (start `{start_one}`)"
    elif stores.committer_running(store):
        why = f"the committer of {where} did not commit them within deadline_s={deadline_s:g}s"
    else:
        why = f"the committer that ran stopped before committing them (start `{start_one}`)"
    log.warning(
        "%s staged in %s %s not committed: %s; %s kept in staging",
        steps,
        where,
        "were" if many else "was",
        why,
        "they are" if many else "it is",
    )
