"""A process's snapshot files: the node-dir files a CPU state's big tensors are copied into at a fast save, so the
background renames each new object into place instead of writing it (the second copy of every byte a save made
before: two thirds of its CPU, docs/figures.md).

Owner: the process. It has a dir of its own, ``slots/rank_K-<pid>-<token>/`` in the node dir (a ghost's or another
launch's never shares a file with it), with one file per tensor of at least :data:`~.pieces.OBJECT_MIN` bytes,
mapped for writing. At a save, :func:`~.codec.snapshot` copies each such tensor into its slot. Once the piece is
hashed, a slot holding an object this rank writes for its node (:mod:`.sharing`) that the node lacks is renamed
into ``objects/`` under its hash (:meth:`Slots.adopt`): it is then that object's file, never written again. A spare
takes its place (the pages of an object no copy names any more), or else a new file, faulted in by the background
before the next snapshot (:meth:`Slots.refill`). Every other slot stays, to be overwritten by the next snapshot,
which runs only while no save of the world's runs (each rank settles its own first, then all agree).

A new file is allocated whole (``posix_fallocate``) before it is mapped: a write through a mapping into a full
tmpfs is a SIGBUS, not an error. A slot that cannot be made leaves its tensor in the snapshot's own buffer (the
save writes it as before) and says why in ``failed``. A dead process's dirs are removed by the node's keeper at
restore (:meth:`~.local.NodeTier.drop_all_but`); :meth:`Slots.release` removes this process's own at close.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.checkpoint.fast import pieces
from pipeline.checkpoint.fast.local import NodeTier
from pipeline.checkpoint.fast.prefault import populate as populate_pages
from pipeline.storage.atomic import clear_file, remove_tree
from pipeline.storage.faults import io_op

MAPS_MAX = 16384
"""The most mappings a process keeps (Linux allows 65,530 by default, ``vm.max_map_count``, and the restore maps
pieces too): beyond half of it a tensor stays in the snapshot's buffer, beyond all of it a named file's mapping is
not kept."""


@dataclass(frozen=True)
class Slot:
    path: Path
    tensor: torch.Tensor
    """A uint8 tensor over the file's shared, writable mapping."""


class Slots:
    """One process's snapshot files in its node dir (see the module docstring)."""

    def __init__(self, node: NodeTier, rank: int) -> None:
        self.node = node
        self.dir = node.root / "slots" / f"rank_{rank}-{os.getpid()}-{secrets.token_hex(4)}"
        self._held: dict[int, Slot] = {}
        """By where its tensor starts in the blob."""
        self._spares: dict[int, list[Path]] | None = None
        """The node's spares by size, listed at the first slot made since :meth:`begin` (none made: no listing)."""
        self.failed = ""
        """Why the last slot that could not be made was not (its tensor went into the snapshot's buffer)."""
        self.reused = 0
        """Slots made from spares (the pages of objects no copy names any more)."""
        self._named: dict[int, tuple[str, torch.Tensor]] = {}
        """By inode: the objects this process named, still mapped (a spare made of one again is a slot with its
        pages mapped in already; mapping them in again costs as much CPU as the copy into them)."""

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.numel() for s in self._held.values())

    def begin(self) -> None:
        """Before a snapshot, a refill or a receive: the spares are listed again when one is wanted, and slots
        removed under this process (its dir gone: a restore's keeper) are made anew."""
        self._spares = None
        if self._held and not self.dir.is_dir():
            self._held = {}

    def take(self, at: int, size: int) -> torch.Tensor | None:
        """The slot for the tensor at ``at`` of ``size`` bytes (:data:`~.codec.Place`); None: it stays in the
        snapshot's buffer (too small to be an object, or no slot could be made)."""
        return self._slot(at, size, populate=False)

    def _slot(self, at: int, size: int, populate: bool) -> torch.Tensor | None:
        if size < pieces.OBJECT_MIN:
            return None
        slot = self._held.get(at)
        if slot is not None and slot.tensor.numel() != size:
            del self._held[at]  # another layout: a new one
            slot = None
        if slot is None:
            if len(self._held) >= MAPS_MAX // 2:
                self.failed = f"more than {MAPS_MAX // 2} tensors of {pieces.OBJECT_MIN} bytes or more"
                return None
            slot = self._try(size, populate)
            if slot is None:
                return None
            self._held[at] = slot
        return slot.tensor

    def scratch(self, size: int) -> Slot | None:
        """A file of ``size`` bytes in this process's dir (a spare's pages, or new), mapped for writing and held by
        the caller: bytes received for an object go straight into it, then the node's
        :meth:`~.local.NodeTier.adopt` names it (or the caller removes it). None: none could be made."""
        return self._try(size, populate=True)

    def _try(self, size: int, populate: bool) -> Slot | None:
        try:
            return self._make(size, populate)
        except OSError as e:
            self.failed = f"{self.dir}: {e.strerror or e}"
            return None

    def _make(self, size: int, populate: bool) -> Slot:
        name = f"{size}-{secrets.token_hex(6)}.bin"
        if self._spares is None:
            self._spares = self.node.spares()
        path = self.node.take_spare(self._spares.get(size, []), self.dir, name)
        if path is None:
            path = self.dir / name
            if not self.dir.is_dir():
                io_op("mkdir", self.dir)
                self.dir.mkdir(parents=True, exist_ok=True)
            io_op("create", path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.close(fd)
                clear_file(path)
                raise
            os.close(fd)
        else:
            self.reused += 1
            kept = self._named.pop(os.stat(path).st_ino, None)  # a mapping keeps its inode's number unreused
            if kept is not None and kept[1].numel() == size:
                return Slot(path, kept[1])
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)  # a link is refused, never written through
            try:
                if os.fstat(fd).st_size != size:
                    raise OSError(f"{path} is not {size} bytes")
                mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError:
            clear_file(path)  # not a slot: nothing of this process's may stay behind unheld
            raise
        if hasattr(mmap, "MADV_DONTFORK"):  # a forked child (a DataLoader's worker) would keep the file's pages
            with contextlib.suppress(OSError):  # alive after it is removed, for as long as the child lives
                mapped.madvise(mmap.MADV_DONTFORK)
        tensor = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the mapping alive
        if populate:  # in the background: its pages mapped in now, not one trap each in the snapshot's copy (in
            populate_pages(tensor)  # the snapshot itself, the copy's traps cost less than mapping them in first)
        return Slot(path, tensor)

    def adopt(self, at: int, h: str) -> bool:
        """The slot of the tensor at ``at`` (:meth:`held`), just hashed to ``h``, renamed into the node's objects
        (this rank writes that object for its node); False: the node has it already (the slot stays)."""
        slot = self._held[at]
        if self.node.has_object(h, slot.tensor.numel()):
            return False
        self.name(slot, h)
        del self._held[at]
        return True

    def name(self, slot: Slot, h: str) -> None:
        """``slot``, holding the object ``h``'s bytes (checked by the caller), made the node's object ``h``. Its
        mapping is kept (never written while it is an object) until :meth:`refill` finds it gone."""
        ino = os.stat(slot.path).st_ino
        self.node.adopt(slot.path, h)
        if len(self._named) + len(self._held) < MAPS_MAX:
            self._named[ino] = (h, slot.tensor)

    def held(self, at: int) -> bool:
        return at in self._held

    def refill(self, spans: Iterable[tuple[int, int]]) -> None:
        """After a save (the background): a slot, faulted in, for every big tensor that lacks one."""
        self.begin()
        for b, e in spans:
            self._slot(b, e - b, populate=True)
        for ino, (h, _) in list(self._named.items()):  # gone, or a spare another writer took: unmapped
            try:
                if os.stat(self.node.object_path(h)).st_ino == ino:
                    continue
            except OSError:
                pass
            del self._named[ino]

    def release(self) -> None:
        """Remove this process's slots (at close, or when the tier turns off)."""
        self._held, self._named = {}, {}  # a save that still runs sees none (then fails)
        with contextlib.suppress(OSError):  # the dir holds only this process's files: one removal, never an error
            remove_tree(self.dir)  # at close
