"""Closing a job whose steps an external committer commits (``Checkpointer(committer="external")``): rank 0 waits,
bounded, until ``python -m pipeline.commit <dir> --follow`` (or any committer holding the dir's lease) has moved
``latest`` to the last step this job saved (or beyond), and names in a WARNING what is missing otherwise: each
step newer than ``latest``, staged, published with ``latest`` not moved to it yet, or absent (quarantined). Never
raises for them: staged steps stay staged for the next committer.

The wait ends on ``latest`` alone (:meth:`~pipeline.checkpoint.stores.store.CheckpointStore.read_latest`), never on a
step having left staging or being published: a committer publishes a step, then moves ``latest``, and a job that
closed in between would leave ``latest`` behind the step it saved last.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pipeline.checkpoint.protocol.lease_records import Watch
from pipeline.checkpoint.stores import stores
from pipeline.checkpoint.stores.remote import Remote
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.errors import DeadlineError, PipelineError
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.waiting import wait_until

log = logging.getLogger("pipeline.checkpoint.checkpointer")
"""The Checkpointer's logger: these warnings are its ``close``'s."""

STAGED, PUBLISHED, ABSENT = "staged", "published", "absent"
"""Where a saved step newer than ``latest`` is: still staged; published, ``latest`` not moved to it yet; neither
(quarantined by the committer, or removed): no committer will move ``latest`` to it."""


@dataclass(frozen=True)
class Pending:
    """One look at the store: the step ``latest`` names (None: no ``latest``), and each saved step newer than it
    with where it is (:data:`STAGED`, :data:`PUBLISHED` or :data:`ABSENT`); empty once ``latest`` is at or
    beyond the last saved step."""

    latest: int | None
    missing: dict[int, str] = field(default_factory=dict)

    def of(self, where: str) -> list[int]:
        return [step for step, state in self.missing.items() if state == where]


def pending(store: CheckpointStore, saved: list[int]) -> Pending:
    """Which of ``saved`` ``latest`` has not reached yet, and where each is. Raises what reading ``latest`` or
    listing the store raises (a VerificationError for a ``latest`` naming a step retired while read, OSError)."""
    latest = store.read_latest()
    step = latest.step if latest is not None else None
    ahead = sorted(s for s in set(saved) if step is None or s > step)
    if not ahead:
        return Pending(step)
    # Staging is listed before each step's committed name is asked for: a step published in between is found
    # published, never absent.
    staged = set(store.staged())
    missing = {s: STAGED if s in staged else PUBLISHED if store.is_published(s) else ABSENT for s in ahead}
    if ABSENT in missing.values():  # a step published, latest moved past it and the step retired meanwhile
        again = store.read_latest()
        if again is not None and again.step >= ahead[-1]:
            return Pending(again.step)
    return Pending(step, missing)


def await_external_commit(
    layout: CheckpointLayout,
    remote: Remote | None,
    world_size: int,
    saved: list[int],
    deadline_s: float,
    wait_s: float,
) -> None:
    """Rank 0 with ``committer="external"``: wait until ``latest`` names the last step this job saved
    (``max(saved)``) or a newer one, for ``wait_s`` while no committer holds the dir (a running one: up to
    ``deadline_s``; no longer once every step still missing is absent, which no committer will commit).
    What is still missing is named in a WARNING; staged steps stay staged for the next committer. Never raises
    for them. ``world_size``: kept for the caller; ``latest`` alone decides."""
    del world_size
    if not saved:
        return
    store = stores.store_for(layout, remote)
    where = store.where
    last_seen: float | None = None  # monotonic time a committer was last seen running
    start = time.monotonic()

    watch = Watch()  # a committer judged by its record changing on this node's clock, not by comparing clocks

    def seen_now() -> bool:
        try:
            return stores.committer_running(store, watch)
        except (PipelineError, OSError):  # the lease cannot be read now: unknown, the deadline decides
            return last_seen is not None

    def running() -> bool:
        nonlocal last_seen
        if seen_now():
            last_seen = time.monotonic()
            return True
        return time.monotonic() - (last_seen if last_seen is not None else start) < wait_s

    errors: list[str] = []

    def look() -> Pending | None:
        try:
            return pending(store, saved)
        except (PipelineError, OSError) as e:  # latest moved while read, a bucket that did not answer
            errors.append(str(e))
            return None

    gone_before = False  # the previous look found every missing step absent

    def settled() -> Pending | None:
        nonlocal gone_before
        found = look()
        if found is None:
            gone_before = False
            return None
        if not found.missing:
            return found
        gone = set(found.missing.values()) == {ABSENT}
        if gone and gone_before:  # twice in a row: nothing is left that a committer could commit
            return found
        gone_before = gone
        return None

    try:
        final: Pending | None = wait_until(
            settled, deadline_s=deadline_s, what=str, alive=running, interval_s=store.poll_s
        )
    except DeadlineError:  # the deadline, or no committer ran for wait_s: one last look
        final = look()
    if final is None:
        log.warning("cannot tell whether the steps this job saved in %s were committed: %s", where, errors[-1])
        return
    if not final.missing:
        return
    _warn(final, where, layout, deadline_s, last_seen, running_now=seen_now())


def _steps(steps: list[int]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


def _warn(
    found: Pending, where: str, layout: CheckpointLayout, deadline_s: float, last_seen: float | None, running_now: bool
) -> None:
    """The one WARNING of a close that did not see ``latest`` reach the last step the job saved."""
    staged, published, absent = found.of(STAGED), found.of(PUBLISHED), found.of(ABSENT)
    latest = f"still names step {found.latest}" if found.latest is not None else "names no step yet"
    parts = []
    if staged:
        parts.append(f"{_steps(staged)} staged in {where} {'were' if len(staged) > 1 else 'was'} not committed")
    if published:
        them = "them" if len(published) > 1 else "it"
        were = "were" if len(published) > 1 else "was"
        parts.append(f"{_steps(published)} {were} published in {where} but latest {latest} (not moved to {them})")
    if absent:
        are = "are" if len(absent) > 1 else "is"
        parts.append(f"{_steps(absent)} saved in {where} {are} neither staged nor published (quarantined?)")
    start_one = f"python -m pipeline.commit {layout.run_dir}"
    if not staged and not published:
        why = f"no committer will move latest to {'them' if len(absent) > 1 else 'it'}: see the committer's log and "
        why += "the quarantine"
    elif last_seen is None:
        seen = "was seen running" if published else "ran"  # one that published may have stopped between two looks
        why = f"no committer {seen} (start `{start_one}`)"
    elif running_now:
        why = f"the committer of {where} did not commit them within deadline_s={deadline_s:g}s"
    else:
        why = f"the committer that ran stopped before committing them (start `{start_one}`)"
    if staged and len(parts) == 1:
        why += f"; {'they are' if len(staged) > 1 else 'it is'} kept in staging"
    elif staged:
        why += f"; {_steps(staged)} {'are' if len(staged) > 1 else 'is'} kept in staging"
    log.warning("%s: %s", "; ".join(parts), why)
