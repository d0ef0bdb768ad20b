"""Retention's removal of a committed step from a bucket, in two phases, so that a late removal can be undone (the
bucket's side of :mod:`pipeline.checkpoint.protocol.trash`; a bucket has no rename, so the objects stay in place).

Phase one (:func:`retire_step`) copies ``step_N/manifest.json`` to ``trash/step_N.e<epoch>.<stamp>.json`` and then
deletes the manifest: the step is no longer committed, its objects stay, and nothing (the sweep, a piece's
deletion) removes what a trash record lists. Phase two (:func:`purge`) deletes the record *first*, then the objects
of the attempt it names and the shared pieces no committed manifest or record lists, unless the step is committed
again by then. :func:`restore` writes the manifest back from the newest record (``If-None-Match``) and then reads
that record again: gone means a purge may be deleting the objects, so it takes its manifest back. Either the
restore's second read comes before the purge's deletion of the record (the purge then finds the step committed and
deletes nothing) or after it (the restore withdraws): a brought-back step never loses its objects. A purge leaves
the objects while another record of the step (a ghost's late retention) lists them, and deletes the attempt's rank
0 marker before the rest: a manifest written after that (a ghost's late commit) commits nothing
(:meth:`~pipeline.checkpoint.stores.remote.Remote.committed`).

A committer purges a record after :data:`~pipeline.checkpoint.protocol.trash.GRACE_S` on its own clock, counted
from when it first saw the record (from its write, for its own): anyone else's (a ghost's late retention, a
committer before it), the copies it claimed, and the records it wrote itself, since it may be a ghost whatever its
fence says (issue 48, suspicion (c)); only a caller without a lease (epoch 0) purges its own at once. A new holder
first claims the older epochs' records (:func:`claim`): a predecessor frozen before its purge then finds a record it
did not write listing the step, and leaves its objects.
"""

from __future__ import annotations

import logging
import time

from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.protocol.trash import GRACE_S, at_once, own_entry, parse_entry
from pipeline.checkpoint.stores.remote import TRASH, WITHDRAWN, Remote, parse_record
from pipeline.errors import VerificationError
from pipeline.storage.s3 import Conflict

log = logging.getLogger("pipeline.checkpoint.stores.bucket_store")


def prefix(remote: Remote) -> str:
    return remote.key(TRASH) + "/"


def _name(key: str) -> str:
    """A record's name as the directory's trash names its entries: ``step_N.e<E>.<t>`` (written by the retention
    of epoch E) or ``step_N.c<E>.<t>`` (an older epoch's record, claimed by E: :func:`claim`)."""
    return key.rsplit("/", 1)[-1].removesuffix(".json")


def entries(remote: Remote) -> list[tuple[int, int, str]]:
    """Every trash record as ``(step, epoch, key)`` (the epoch that wrote or claimed it), by step, then epoch."""
    out = []
    where = prefix(remote)
    for key in remote.store.listing(where):
        rel = key[len(where) :]
        parsed = parse_entry(rel.removesuffix(".json")) if rel.endswith(".json") and "/" not in rel else None
        if parsed is not None:
            out.append((*parsed, key))
    return sorted(out)


def claim(remote: Remote, epoch: int) -> None:
    """A new holder's first act on the trash: each record an older epoch wrote (or claimed) is copied as claimed by
    ``epoch``. A predecessor frozen before its purge comes back to delete its own record, finds this copy listing
    the step, and leaves the objects (:func:`purge`); the copy is not this holder's own, so it keeps its
    :data:`GRACE_S` (a fall-back may bring the step back from it meanwhile) and no older epoch purges it at once."""
    records = entries(remote)
    claimed = {step for step, by, key in records if by == epoch and not own_entry(_name(key), epoch)}
    for step, by, key in records:
        if by >= epoch or step in claimed:
            continue
        got = remote.store.get(key)
        if got is None:
            continue  # purged meanwhile
        remote.store.put(remote.key(TRASH, f"step_{step}.c{epoch}.{int(time.time())}.json"), got[0])
        claimed.add(step)


def read_record(remote: Remote, key: str) -> Manifest | None:
    """The manifest a trash record holds (None: gone, or not a manifest)."""
    got = remote.store.get(key)
    if got is None:
        return None
    try:
        return Manifest.from_json(parse_record(got[0], "trash record", remote.url(key)), remote.url(key))
    except VerificationError:
        return None


def retire_step(remote: Remote, step: int, epoch: int) -> bool:
    """Phase one for ``step``; returns whether its manifest was there to move."""
    got = remote.store.get(remote.manifest_key(step))
    if got is None or got[0] == WITHDRAWN:
        return False
    key = remote.key(TRASH, f"step_{step}.e{epoch}.{int(time.time())}.json")  # the stamp only names it
    remote.store.put(key, got[0])
    remote.store.delete([remote.manifest_key(step)])
    return True


def purge(remote: Remote, epoch: int, first_seen: dict[str, float]) -> list[str]:
    """Phase two for the records this committer may purge now; returns the piece keys their manifests listed
    (for the caller to drop those no committed manifest lists)."""
    now = time.monotonic()
    pieces: list[str] = []
    for step, _, key in entries(remote):
        if not at_once(_name(key), epoch) and now - first_seen.setdefault(key, now) < GRACE_S:
            continue  # restorable for the grace period (its own too: this committer may be a ghost)
        manifest = read_record(remote, key)
        remote.store.delete([key])  # first: a restore that reads it again after this withdraws
        first_seen.pop(key, None)
        there = remote.store.get(remote.manifest_key(step))
        if manifest is None or (there is not None and there[0] != WITHDRAWN):
            continue  # brought back (or committed again): its objects are the step's
        if any(s == step and k != key for s, _, k in entries(remote)):
            continue  # another record (a ghost's late retention) lists them: a fall-back may still bring it back
        attempt = remote.attempt_prefix(step, manifest.attempt)
        remote.store.delete([remote.marker_key(step, manifest.attempt, 0)])  # first: a late manifest commits nothing
        remote.store.delete(sorted(remote.store.listing(attempt)))
        pieces += sorted(remote.piece_keys(manifest.files))
        log.info("retention: purged step %d from %s", step, remote.url(key))
    return pieces


def restore(remote: Remote, step: int) -> bool:
    """Bring ``step`` back from its newest trash record (see the module docstring); returns whether it did."""
    found = [key for s, _, key in entries(remote) if s == step]  # the newest epoch's last: a claim, if any
    if not found:
        return False
    got = remote.store.get(found[-1])
    if got is None:
        return False
    manifest_key = remote.manifest_key(step)
    try:
        etag = remote.store.put(manifest_key, got[0], if_none_match=True)
    except Conflict:  # back already (another committer's restore: the same bytes), or committed again
        now = remote.store.get(manifest_key)
        if now is None or now[0] != WITHDRAWN:
            return now is not None and now[0] == got[0]
        try:  # a manifest its writer took back: commits nothing, replaced as that very object
            etag = remote.store.put(manifest_key, got[0], if_match=now[1])
        except Conflict:
            return False
    if remote.store.get(found[-1]) is None:  # purged meanwhile: its objects may be going
        remote.withdraw_manifest(step, etag)  # this write only: another's commit of the step since stays
        log.warning("step %d was being purged from the trash: not brought back", step)
        return False
    log.warning("step %d brought back from the trash (%s): latest needs it", step, remote.url(found[-1]))
    return True
