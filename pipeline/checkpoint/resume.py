"""The resume decision: made once, by one process (rank 0), and handed to every rank.

A step staged completely before a kill or a requeue is committed first (by whichever committer runs: the app's
job beside train, a rank-0 thread, ``python -m pipeline.commit``), so it is never lost, never trained again and
never rewritten while the committer reads it; then the newest committed step is verified against its manifest.
Every wait is bounded by a deadline and ends early once the committer is gone.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.checkpoint.committer import staged_uncommitted
from pipeline.checkpoint.manifest import read_latest, read_newest, verify_committed
from pipeline.checkpoint.remote import Remote
from pipeline.checkpoint.remote import staged_uncommitted as remote_staged
from pipeline.errors import DeadlineError, PipelineError
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.waiting import wait_until


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

    def pending() -> list[int]:
        if remote is not None:
            return remote_staged(remote, world_size, upto)
        return staged_uncommitted(layout, world_size, upto)

    where = remote.root if remote is not None else layout.staging
    try:
        wait_until(
            lambda: None if pending() else True,
            deadline_s=deadline_s,
            what=lambda: (
                f"step(s) {pending()} in {where} have every rank's marker but are not committed{committer_hint}"
            ),
            alive=committer_alive,
            interval_s=0.2 if remote is None else 0.5,
        )
    except DeadlineError as e:
        return f"cannot resume: {e}"
    try:
        if remote is not None:  # pull verifies every file while reading it
            latest = read_latest(remote.pull())
            return latest.step if latest else 0
        latest = read_newest(layout)
        if latest is None:
            return 0
        verify_committed(layout.committed_step(latest.step), latest.step)
    except PipelineError as e:  # a damaged step, or the bucket refusing (a StoreError): every rank hears why
        return f"cannot resume: {e}{repair_hint}"
    return latest.step
