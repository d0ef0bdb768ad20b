"""The resume decision: made once, by one process (rank 0), and handed to every rank.

A step staged completely before a kill or a requeue is committed first (by whichever committer runs: the app's
job beside train, a rank-0 thread, ``python -m pipeline.commit``), so it is never lost, never trained again and
never rewritten while the committer reads it; then the newest committed step is verified against its manifest.
Every wait is bounded by a deadline and ends early once the committer is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pipeline.checkpoint.manifest import read_newest, verify_committed
from pipeline.checkpoint.protocol.lease_records import Watch
from pipeline.checkpoint.stores.remote import Remote
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.checkpoint.stores.stores import committer_running, store_for, uncommitted
from pipeline.errors import DeadlineError, PipelineError, ReadFailed
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.waiting import wait_until

log = logging.getLogger(__name__)


def decide(
    layout: CheckpointLayout,
    world_size: int,
    *,
    deadline_s: float,
    committer_alive: Callable[[], bool],
    upto: int | None = None,
    committer_hint: str = "",
    repair_hint: str = "",
    remote: Remote | None = None,
) -> int | str:
    """The step to resume from (0: start fresh), or why it cannot be decided: a message every rank raises, so
    no rank waits for a broadcast that never comes. ``upto``: staged steps above it are not waited for.

    With ``remote`` (checkpoints in a bucket) the complete uncommitted steps are looked for there, and the step
    ``latest`` names is pulled into ``remote``'s local cache (every file checked against its manifest while
    read), from which every rank loads."""

    store = store_for(layout, remote)

    def pending() -> list[int]:
        return uncommitted(store, world_size, upto)

    start = time.monotonic()
    while True:
        try:
            wait_until(
                lambda: None if pending() else True,
                deadline_s=max(0.0, deadline_s - (time.monotonic() - start)),
                what=lambda: (
                    f"step(s) {pending()} in {store.where} have every rank's marker but are not committed"
                    f"{committer_hint}"
                ),
                alive=committer_alive,
                interval_s=store.poll_s,
            )
            local = store.local()  # a bucket's latest step: pulled, every file checked while read
            latest = read_newest(local)
            # a commit in flight during the read (a step moved into place, its manifest not yet written, while a
            # repair had removed latest): what was read is not the newest step the run has; look again
            now, read = store.newest(), latest.step if latest is not None else 0
            again = time.monotonic() - start < deadline_s and (pending() or (now.step if now else 0) != read)
        except DeadlineError as e:
            return f"cannot resume: {e}"
        except PipelineError as e:  # a damaged step, a read that keeps failing, a bucket refusing: never older
            return f"cannot resume: {e}{repair_hint}"
        if not again:
            break
    if latest is None:
        return 0
    try:
        verify_committed(local.committed_step(latest.step), latest.step)
    except PipelineError as e:  # a damaged step, or the bucket refusing (a StoreError): every rank hears why
        return f"cannot resume: {e}{repair_hint}"
    return latest.step


EXTERNAL_START_S = 60.0
"""How long a resuming rank 0 gives an external committer to appear before it counts as gone."""


def decide_with(
    layout: CheckpointLayout,
    world_size: int,
    deadline_s: float,
    thread_alive: Callable[[], bool] | None,
    remote: Remote | None,
) -> int | str:
    """:func:`decide` for the library: the committer is rank 0's thread (``thread_alive``), or else an external
    one, which counts as alive while it holds the dir, or for :data:`EXTERNAL_START_S` while it may still start."""
    start = time.monotonic()
    store = store_for(layout, remote)
    watch = Watch()  # a committer judged by its record changing on this node's clock, not by comparing clocks

    def alive() -> bool:
        if thread_alive is not None:
            return thread_alive()
        try:
            if committer_running(store, watch):  # the lease where the store keeps it (a bucket's in the bucket)
                return True
        except (ReadFailed, OSError):
            return True  # the lease cannot be read now: unknown, so the deadline decides
        return time.monotonic() - start < EXTERNAL_START_S

    return decide(
        layout,
        world_size,
        deadline_s=deadline_s,
        committer_alive=alive,
        committer_hint=f" (is the committer running? python -m pipeline.commit {layout.run_dir} --follow)",
        remote=remote,
    )


def log_resumed(store: CheckpointStore, step: int) -> None:
    """Rank 0: one INFO line saying which step a launch resumed from and where (the fast tier logs its own)."""
    if step == 0:
        log.info("no committed step in %s: starting from step 0", store.where)
    else:
        log.info("resumed from step %d of %s (committed, verified against its manifest)", step, store.where)
