"""Shared pieces in a bucket (``pieces/<xxh3-128>``): which are still needed, and deleting the rest.

Inputs: the committed manifests (and, for the sweep, the markers of staged attempts) under one checkpoints root.
Outputs: deletions of piece objects that no committed manifest lists; a quarantined attempt's note on its pieces;
which pieces of a step that failed verification are damaged, and which other committed steps list them (the
committer quarantines those too: one object, one damage).
Owner: the one committer (``pipeline/checkpoint/remote_committer.py``) calls these; nothing else deletes a piece.

A piece is deleted only when no committed manifest lists it, decided from every committed manifest read at that
moment; when one cannot be read nothing is deleted (recovery decides about a damaged manifest, not a deletion).
Retention drops the pieces of the step it removed; the committer's last pass also sweeps pieces that neither a
committed manifest nor a staged marker lists (a crash between a step's deletion and its pieces', a refused
attempt's uploads), when no rank of the run uploads any more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pipeline.checkpoint.stores import bucket_trash
from pipeline.checkpoint.stores.remote import Remote, is_marker_name
from pipeline.errors import PipelineError, VerificationError
from pipeline.formats.dcp_names import is_piece
from pipeline.storage.faults import inject
from pipeline.storage.integrity import FileEntry

log = logging.getLogger(__name__)


def referenced(remote: Remote) -> set[str] | None:
    """Every piece key a committed manifest or a trash record lists; None when one cannot be read."""
    keys: set[str] = set()
    for step in remote.committed():
        found = remote.read_manifest_or_none(step)
        if found is None:
            return None
        keys |= remote.piece_keys(found.files)
    for _, _, key in bucket_trash.entries(remote):  # a retired step can still come back: its pieces stay
        held = bucket_trash.read_record(remote, key)
        if held is None and remote.store.get(key) is not None:
            return None
        keys |= remote.piece_keys(held.files) if held is not None else set()
    return keys


def drop(remote: Remote, candidates: set[str]) -> list[str]:
    """Delete those of ``candidates`` that no committed manifest lists; returns the keys deleted."""
    if not candidates:
        return []
    needed = referenced(remote)
    doomed = sorted(candidates - needed) if needed is not None else []
    if doomed:
        inject("retention.pieces", count=len(doomed))
        remote.store.delete(doomed)
        log.info("deleted %d shared piece(s) no committed step lists", len(doomed))
    return doomed


def sweep(remote: Remote, world_size: int) -> list[str]:
    """Delete pieces that neither a committed manifest nor a marker of a staged attempt lists. For the last pass
    only: a piece uploaded before its marker must never be taken for litter while its rank still runs."""
    stored = set(remote.store.listing(remote.pieces_prefix()))
    if not stored:
        return []
    staged: set[str] = set()
    committed = set(remote.committed())
    for step in remote.steps():
        if step in committed:
            continue
        for attempt in remote.attempts(step):
            try:
                markers = remote.markers(step, attempt, world_size)
            except VerificationError:
                return []  # a damaged marker may list anything: keep every piece
            for m in markers:
                if m is not None:
                    staged |= remote.piece_keys(m.files)
    return drop(remote, stored - staged)


def quarantine_note(remote: Remote, step: int, attempt: str, keys: list[str]) -> str:
    """What a quarantined attempt's markers list as shared pieces (left in ``pieces/``, not copied)."""
    pieces: dict[str, int] = {}
    for key in keys:
        leaf = key.rsplit("/", 1)[-1]
        if not is_marker_name(leaf):
            continue
        try:
            marker = remote.read_marker(step, attempt, int(leaf.split("_")[1].split(".")[0]))
        except VerificationError:
            continue
        for e in marker.files if marker is not None else ():
            pieces.update({k: e.size for k in remote.piece_keys((e,))})
    if not pieces:
        return ""
    return (
        f"shared pieces its markers list (left in {remote.url(remote.pieces_prefix())}, not copied: "
        f"{len(pieces)} object(s), {sum(pieces.values())} bytes): {', '.join(sorted(pieces))}\n"
    )


def damaged(remote: Remote, files: Iterable[FileEntry], among: set[str]) -> dict[str, FileEntry]:
    """The pieces among ``files`` with a key in ``among`` whose object is missing, or has another size or hash
    than listed: key -> entry (each read once; one that cannot be read now is not called damaged)."""
    out: dict[str, FileEntry] = {}
    seen: set[str] = set()
    for e in files:
        keys = remote.piece_keys((e,)) & among if is_piece(e.path) else set()
        for key in keys - seen:
            seen.add(key)
            try:
                info = remote.store.head(key)
                ok = info is not None and info.size == e.size
                ok = ok and remote.store.download(key, e.size, None) == (e.size, e.hash)
            except (PipelineError, OSError):
                continue
            if not ok:
                out[key] = e
    return out


def holders(remote: Remote, keys: set[str], besides: int) -> dict[int, list[str]]:
    """Committed steps other than ``besides`` whose manifest lists one of ``keys``: step -> those keys."""
    out: dict[int, list[str]] = {}
    for step in remote.committed() if keys else []:
        found = remote.read_manifest_or_none(step) if step != besides else None
        hit = sorted(remote.piece_keys(found.files) & keys) if found is not None else []
        if hit:
            out[step] = hit
    return out
