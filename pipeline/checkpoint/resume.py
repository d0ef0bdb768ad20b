"""The resume decision: made once, by one process (rank 0), and handed to every rank.

A step staged completely before a kill or a requeue is committed first (by whichever committer runs: the app's
job beside train, a rank-0 thread, ``python -m pipeline.commit``), so it is never lost, never trained again and
never rewritten while the committer reads it; then the newest committed step is verified against its manifest.
Every wait is bounded by a deadline and ends early once the committer is gone.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.checkpoint.committer import staged_uncommitted
from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.checkpoint.remote import Remote
from pipeline.checkpoint.remote import staged_uncommitted as remote_staged
from pipeline.errors import DeadlineError, PipelineError, VerificationError
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
) -> int | str:
    """The step to resume from (0: start fresh), or why it cannot be decided: a message every rank raises, so
    no rank waits for a broadcast that never comes. ``upto``: staged steps above it are not waited for."""
    try:
        wait_until(
            lambda: None if staged_uncommitted(layout, world_size, upto) else True,
            deadline_s=deadline_s,
            what=lambda: (
                f"step(s) {staged_uncommitted(layout, world_size, upto)} in {layout.staging} have every rank's "
                f"marker but are not committed{committer_hint}"
            ),
            alive=committer_alive,
            interval_s=0.2,
        )
    except DeadlineError as e:
        return f"cannot resume: {e}"
    try:
        latest = read_latest(layout)
        if latest is None:
            return 0
        verify_committed(layout.committed_step(latest.step), latest.step)
    except VerificationError as e:
        return f"cannot resume: {e}{repair_hint}"
    return latest.step


def decide_remote(
    remote: Remote,
    world_size: int,
    *,
    deadline_s: float,
    committer_alive: Callable[[], bool],
    upto: int | None = None,
    committer_hint: str = "",
    repair_hint: str = "",
) -> int | str:
    """:func:`decide` for checkpoints in a bucket: wait the same way for complete uncommitted steps there, then
    pull the step ``latest`` names into the local cache (every file checked against its manifest while read),
    from which every rank loads."""
    try:
        wait_until(
            lambda: None if remote_staged(remote, world_size, upto) else True,
            deadline_s=deadline_s,
            what=lambda: (
                f"step(s) {remote_staged(remote, world_size, upto)} in {remote.root} have every rank's marker but "
                f"are not committed{committer_hint}"
            ),
            alive=committer_alive,
            interval_s=0.5,
        )
    except DeadlineError as e:
        return f"cannot resume: {e}"
    try:
        cache = remote.pull()
        latest = read_latest(cache)
    except PipelineError as e:  # a damaged step, or the bucket refusing (a StoreError): every rank hears why
        return f"cannot resume: {e}{repair_hint}"
    return latest.step if latest else 0
