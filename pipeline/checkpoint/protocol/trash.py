"""Retention's removal of a committed step from a directory, in two phases, so that a late removal can be undone.

Phase one moves ``checkpoints/step_N`` in one rename to ``checkpoints/.deleting/step_N.e<epoch>.<stamp>`` (the
epoch of the committer that moved it); phase two (:func:`purge`) deletes it once it has stayed for :data:`GRACE_S`
on the purger's own clock, counted from when it first saw the entry (for what it moved itself: from the move). That
holds for what a committer moved itself too: a committer under a lease may be a ghost whatever its fence says (a
view of the lease can stay stale), and its own move may have landed late, after the holder fell back to that very
step (issue 48, suspicion (c)). Only a caller that holds no lease (epoch 0: a test, a tool alone with the run dir)
purges what it moved at once. Meanwhile :func:`restore` brings a step back when ``latest`` needs it: a fall-back
to the newest step that verifies finds it there. A new holder first renames what lower epochs left there as
claimed by its own epoch (:func:`claim`, ``step_N.c<epoch>.<stamp>``): a late purge by its predecessor then finds
nothing to delete, and the entry keeps its grace. Before moving a step,
:func:`retire_step` re-reads ``latest`` and the newest committed step at the act: neither, nor anything above
them, is ever moved.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from pipeline.checkpoint.manifest import MANIFEST, TRASH
from pipeline.checkpoint.stores.repair import latest_step_name
from pipeline.errors import PipelineError
from pipeline.storage.atomic import clear_file, move_aside, publish_dir, remove_tree
from pipeline.storage.integrity import is_real_dir, lstat_kind
from pipeline.storage.layout import CheckpointLayout, parse_step, step_name

log = logging.getLogger(__name__)

GRACE_S = 120.0
"""How long a step another committer moved to the trash stays restorable, on the purger's own clock."""
_ENTRY = re.compile(r"^step_(\d+)\.([ec])(\d+)\.\d+(?:\.\d+)?$")
"""``step_N.e<E>.<t>``: moved there by the committer of epoch E; ``step_N.c<E>.<t>``: moved by an older epoch,
claimed by E (:func:`claim`). Only the first is E's own to purge at once."""


def trash_dir(layout: CheckpointLayout) -> Path:
    return layout.checkpoints / TRASH


def parse_entry(name: str) -> tuple[int, int] | None:
    """``(step, epoch)`` of a trash entry this module named (the epoch that moved or claimed it), else None."""
    m = _ENTRY.match(name)
    return (int(m.group(1)), int(m.group(3))) if m else None


def own_entry(name: str, epoch: int) -> bool:
    """Whether the entry ``name`` was moved to the trash by the committer of ``epoch`` itself, not claimed. Never a
    higher epoch's: a ghost of a lower epoch took what the holder after it moved for its own, and purged at once
    what that holder may still need (issue 48, suspicion (b)). A bucket's records are named alike, plus ``.json``."""
    m = _ENTRY.match(name)
    return m is not None and m.group(2) == "e" and int(m.group(3)) == epoch


def at_once(name: str, epoch: int) -> bool:
    """Whether the trash entry ``name`` may be purged without waiting out :data:`GRACE_S`: only what a caller
    without a lease (``epoch`` 0) moved itself. A bucket's records are named alike, plus ``.json``."""
    return epoch == 0 and own_entry(name, 0)


def retire_step(layout: CheckpointLayout, step: int, epoch: int) -> bool:
    """Phase one for ``step``, unless the step ``latest`` names or the newest committed step (both re-read now)
    is at or below it; returns whether it moved."""
    committed = [s for s, p in _steps(layout) if lstat_kind(p / MANIFEST) == "file"]
    named = latest_step_name(layout)
    if not committed or step >= max(committed) or (named is not None and step >= named):
        log.warning("retention: step %d is not retired: latest (step %s) or the newest committed step (%s) needs it",
                    step, named, max(committed, default=None))  # fmt: skip
        return False
    src = layout.committed_step(step)
    if not is_real_dir(src):
        return False
    try:
        move_aside(src, trash_dir(layout), f"{step_name(step)}.e{epoch}.{int(time.time())}")
    except FileNotFoundError:  # moved meanwhile (another committer's retention)
        return False
    return True


def _steps(layout: CheckpointLayout) -> list[tuple[int, Path]]:
    """``step_N`` directories of ``checkpoints/`` (lstat only: a link is not a step)."""
    area = layout.checkpoints
    if not is_real_dir(area):
        return []
    out = []
    for p in area.iterdir():
        step = parse_step(p.name)
        if step is not None and is_real_dir(p):
            out.append((step, p))
    return out


def purge(layout: CheckpointLayout, epoch: int, first_seen: dict[str, float]) -> None:
    """Phase two: delete the trash entries this committer may delete now (see the module docstring)."""
    trash = trash_dir(layout)
    kind = lstat_kind(trash)
    if kind is None:
        return
    if kind != "dir":
        clear_file(trash)  # a link or file planted where the trash goes: unlinked, never followed
        return
    now = time.monotonic()
    for entry in sorted(trash.iterdir()):
        if parse_entry(entry.name) is not None and not at_once(entry.name, epoch):  # restorable for a grace
            seen = first_seen.setdefault(entry.name, now)
            if now - seen < GRACE_S:
                continue
        try:
            if is_real_dir(entry):
                remove_tree(entry)
            else:
                clear_file(entry)
        except OSError as e:  # another committer purges the same trash: the next pass finishes it
            log.warning("retention: %s not deleted yet (%s); the next pass finishes it", entry, e)
        first_seen.pop(entry.name, None)


def claim(layout: CheckpointLayout, epoch: int) -> None:
    """A new holder's first act on the trash, before any repair: each entry a lower epoch moved there is renamed
    under ``epoch`` (``step_N.c<epoch>.<t>``). The committer that moved it purges it once its grace is over; frozen
    between its fence and that purge's first act (a rename of the entry's name), it comes back to find the name
    gone, and deletes nothing this holder's fall-back may need (the newer step damaged meanwhile). A claimed entry
    is still not this holder's own: it keeps its :data:`GRACE_S` before this holder purges it, so a fall-back that
    could not bring it back now (an I/O error) can still do so on the next pass or after a rerun."""
    trash = trash_dir(layout)
    if not is_real_dir(trash):
        return
    for entry in sorted(trash.iterdir()):
        parsed = parse_entry(entry.name)
        if parsed is None or parsed[1] >= epoch or not is_real_dir(entry):
            continue
        try:
            move_aside(entry, trash, f"{step_name(parsed[0])}.c{epoch}.{int(time.time())}")
        except FileNotFoundError:  # purged or brought back meanwhile
            continue


def trashed(layout: CheckpointLayout) -> list[int]:
    """Steps whose retired copy (with its manifest) is still in the trash."""
    trash = trash_dir(layout)
    if not is_real_dir(trash):
        return []
    out = set()
    for entry in trash.iterdir():
        parsed = parse_entry(entry.name)
        if parsed is not None and is_real_dir(entry) and lstat_kind(entry / MANIFEST) == "file":
            out.add(parsed[0])
    return sorted(out)


def restore(layout: CheckpointLayout, step: int) -> bool:
    """Bring ``step``'s newest retired copy back from the trash (where no ``step_N`` is); returns whether it did."""
    trash = trash_dir(layout)
    if not is_real_dir(trash) or lstat_kind(layout.committed_step(step)) is not None:
        return False
    found = sorted(
        (e for e in trash.iterdir() if (p := parse_entry(e.name)) is not None and p[0] == step and is_real_dir(e)),
        key=lambda e: e.name,
    )
    if not found:
        return False
    try:
        publish_dir(found[-1], layout.committed_step(step))
    except (OSError, PipelineError) as e:  # purged or restored meanwhile
        log.warning("step %d could not be brought back from %s: %s", step, found[-1], e)
        return False
    log.warning("step %d brought back from the trash (%s): latest needs it", step, found[-1].name)
    return True
