"""Incremental saves: what does not train is written once and shared by the steps after it, each step complete.

A model's parameters that do not train (``requires_grad=False``: a LoRA run's base weights, frozen layers) and
its buffers are saved as pieces of their own (:mod:`pipeline.formats.dcp_pieces`). A rank whose piece has the
same bytes as the latest committed step's piece of that name does not write it again:

* **POSIX**: the step's file is a hard link to the committed step's file. Each step dir still holds every file it
  needs; deleting a step (retention, quarantine) removes its names only, and the bytes stay while any step links
  them, so no committed step can lose a piece. Files are never written in place: a stale file is unlinked before
  a write, so a shared inode is never changed.
* **A bucket**: a piece is stored once, content-addressed, at ``pieces/<xxh3-128>``; the step's marker and
  manifest list it like any file, and readers find it by its hash (:meth:`~pipeline.checkpoint.stores.remote.Remote.
  object_key`). Retention deletes a piece only when no committed manifest lists it.

Either way the committer re-reads and checks every file of a step, shared or not, before its manifest is written.
A piece is taken only from a committed step (POSIX, besides: the step this process saved last, at the very inode
it wrote), with the size listed. A damaged piece that verification finds leaves for ``quarantine/`` with every
committed step that holds it (:func:`pipeline.checkpoint.stores.repair.quarantine_damage`; in a bucket,
:func:`pipeline.checkpoint.stores.remote_pieces.holders`), so no source lists it any more and the next save writes it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

import torch

from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.checkpoint.stores.remote import Remote
from pipeline.errors import PipelineError, VerificationError
from pipeline.formats.dcp_names import is_piece
from pipeline.formats.dcp_pieces import Pieces
from pipeline.storage.atomic import link_file
from pipeline.storage.integrity import FileEntry, safe_join
from pipeline.storage.layout import CheckpointLayout

FROZEN, BUFFERS = "frozen", "buffers"


def shared_groups(module: torch.nn.Module, under: str) -> dict[str, str]:
    """The flattened DCP FQNs (``<under>.<state-dict key>``) of ``module``'s parameters that do not train
    (``frozen``) and of its buffers (``buffers``), for a module saved under ``under`` with torch's
    ``get_state_dict`` (DDP's and FSDP's wrapper prefixes are dropped the same way)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns  # noqa: PLC0415 - torch's own name mapping

    out: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):  # a tied weight under each of its names
        if not param.requires_grad:
            out.update({f"{under}.{fqn}": FROZEN for fqn in _get_fqns(module, name)})
    for name, _ in module.named_buffers(remove_duplicate=False):
        for fqn in _get_fqns(module, name):
            out.setdefault(f"{under}.{fqn}", BUFFERS)
    return out


_RECENT: dict[tuple[Path, int], tuple[int, dict[str, FileEntry], dict[str, tuple[int, int]]]] = {}
"""POSIX: the pieces each rank of this process last saved (by checkpoints dir), with the inode each was written
to, so the next save may link them while that step still waits for its commit (a bucket shares only what a
committed manifest lists). Only that inode is ever linked: a step that was quarantined since (its files moved
out), or a path that names another file now, is not a source."""


def remember(layout: CheckpointLayout, rank: int, step: int, files: tuple[FileEntry, ...]) -> None:
    """Rank ``rank`` wrote its marker for ``step`` listing ``files``: its pieces may be linked by its next save."""
    own = {e.path: e for e in files if e.path.startswith(f"__{rank}_") and is_piece(e.path)}
    inodes: dict[str, tuple[int, int]] = {}
    for name in own:
        try:
            st = os.lstat(layout.staged_step(step) / name)
        except OSError:
            continue
        inodes[name] = (st.st_dev, st.st_ino)
    _RECENT[(layout.checkpoints, rank)] = (step, own, inodes)


def _mine(rank: int, files: tuple[FileEntry, ...]) -> dict[str, FileEntry]:
    own = f"__{rank}_"
    return {e.path: e for e in files if e.path.startswith(own) and is_piece(e.path)}


def bucket_source(remote: Remote, rank: int, groups: Mapping[str, str]) -> Pieces:
    """How ``rank``'s save may share pieces in a bucket: its pieces the latest committed manifest lists stay
    where they are (``pieces/<hash>``): the marker lists them, nothing is uploaded. With none readable the save
    writes everything."""
    try:
        found = remote.verified_latest()
    except (PipelineError, OSError):  # a damaged latest, an unreachable bucket: every piece is written
        return Pieces(groups)
    listed = _mine(rank, found[0].files) if found else {}
    return Pieces(groups, listed, lambda name: _still_stored(remote, listed[name]))


def posix_source(layout: CheckpointLayout, rank: int, staged: Path, groups: Mapping[str, str]) -> Pieces:
    """How ``rank``'s save into ``staged`` may share pieces: its pieces in the latest committed step, or in the
    step this process saved last, still staged or committed since (hard-linked). With none readable the save
    writes everything."""

    def mine(files: tuple[FileEntry, ...]) -> dict[str, FileEntry]:
        return _mine(rank, files)

    previous: dict[str, FileEntry] = {}
    sources: list[Path] = []
    latest = None
    try:
        latest = read_latest(layout)
        if latest is not None:
            sources = [layout.committed_step(latest.step)]
            previous = mine(read_manifest(sources[0]).files)
    except (VerificationError, OSError):
        previous, sources = {}, []
    step, recent, inodes = _RECENT.get((layout.checkpoints, rank), (0, {}, {}))
    only: dict[str, tuple[int, int]] | None = None  # None: any file of the committed step with the listed size
    if recent and (latest is None or step > latest.step):
        previous = recent  # newer than latest: its files are where the committer leaves them, staged or published
        sources = [layout.staged_step(step), layout.committed_step(step)]
        only = inodes

    def reuse(name: str) -> bool:
        if only is not None and name not in only:
            return False
        ident = only[name] if only is not None else None
        return any(link_piece(src, staged, name, previous[name].size, ident) for src in sources)

    return Pieces(groups, previous, reuse)


def _still_stored(remote: Remote, entry: FileEntry) -> bool:
    """The piece object the latest manifest lists is there with its size (a HEAD): else it is uploaded again,
    so one lost object cannot fail every later save."""
    try:
        info = remote.store.head(remote.pieces_prefix() + entry.hash)
    except (VerificationError, OSError, PipelineError):
        return False
    return info is not None and info.size == entry.size


def link_piece(
    step_dir: Path, staged: Path, name: str, size: int | None = None, inode: tuple[int, int] | None = None
) -> bool:
    """Hard-link the committed step's file ``name`` into ``staged`` (replacing a stale one there); False when it
    cannot be (gone by retention or quarantine meanwhile, a filesystem without hard links) or when it is not the
    file expected (``size`` bytes; ``inode``: that very file): the piece is then written."""
    try:
        src = safe_join(step_dir, name)  # every component lstat-checked: a planted link is never followed
        st = os.lstat(src)
        if not stat.S_ISREG(st.st_mode) or size is not None and st.st_size != size:
            return False
        if inode is not None and (st.st_dev, st.st_ino) != inode:
            return False
        link_file(src, staged / name)
    except (OSError, VerificationError):
        return False
    return True
