"""The node-local tier's files: every copy written by its one owner, verified before anything uses it.

Under ``<fast dir>/<run key>/`` (a RAM-backed dir by default, one per node):

* ``own/rank_K/step_N.{bin,json}``: rank ``K``'s shard of step ``N``, written by the process that is rank ``K``;
* ``replica/rank_K/step_N.{bin,json}``: a replica of rank ``K``'s shard, written by ``K``'s peer on this node;
* ``objects/<hash>.bin``: the tensors those copies share (:mod:`.pieces`), each once per node, named by the
  hash of its bytes; written by the lowest rank of the node that needs it (for a replica, the lowest receiver),
  removed by the node's keeper once no copy it keeps names it;
* ``slots/``: each process's snapshot files (:mod:`.slots`), its own, renamed into ``objects/`` when they
  hold a new object; removed by the keeper at restore (a dead process's), by the process at close;
* ``quarantine/``: copies that failed verification, moved aside with a note, never offered again;
* ``node.id``: a token created once (``O_EXCL`` on the node's own filesystem), which tells the ranks sharing
  this dir apart from those of other nodes; the lowest rank sharing it is the dir's *keeper* (it scans,
  quarantines and prunes what earlier launches left).

A copy's ``.bin`` holds its inline pieces; the ``.json`` marker is written last (atomically), after the objects
it names: the step, whose shard, the world size, the launch's attempt, the blob's size and digest, its pieces
(length, hash, object or inline), and the table of every rank's size and digest for the step (gathered before any
copy is written), so any copy can be checked against what the other holders recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.checkpoint.fast.pieces import Part, digest, digest_of, inline_size
from pipeline.storage.atomic import (
    clear_file,
    create_exclusive,
    move_aside,
    overwrite_file,
    remove_tree,
    replace_file,
    write_bytes_atomic,
    write_json_atomic,
)

KINDS = ("own", "replica")
_STEP = re.compile(r"^step_(\d+)\.json$")
_RANK = re.compile(r"^rank_(\d+)$")


__all__ = ["KINDS", "Copy", "NodeTier", "digest", "run_key"]
_OBJECT = re.compile(r"^([0-9a-f]{32})\.bin$")


def run_key(run_dir: Path) -> str:
    """The node-local dir's name for one run (two runs never share one)."""
    return f"{run_dir.name}-{hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class Copy:
    """One copy of one rank's shard of one step, as its marker describes it."""

    step: int
    shard: int
    """The rank whose state it is."""
    kind: str
    world_size: int
    attempt: str
    size: int
    hash: str
    table: tuple[tuple[int, str], ...]
    """Every rank's (size, hash) for the step, as gathered when it was saved."""
    pieces: tuple[Part, ...] = ()
    """The blob's pieces (:mod:`.pieces`); none: one inline piece, the whole blob."""

    @property
    def parts(self) -> tuple[Part, ...]:
        return self.pieces or ((self.size, self.hash, False),)

    def marker(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "shard": self.shard,
            "kind": self.kind,
            "world_size": self.world_size,
            "attempt": self.attempt,
            "size": self.size,
            "hash": self.hash,
            "table": [list(t) for t in self.table],
            "pieces": [list(p) for p in self.parts],
        }

    @classmethod
    def of(cls, rec: Any) -> Copy:
        table = tuple((int(s), str(h)) for s, h in rec["table"])
        pieces = tuple((int(n), str(h), bool(o)) for n, h, o in rec.get("pieces", ()))
        return cls(
            int(rec["step"]),
            int(rec["shard"]),
            str(rec["kind"]),
            int(rec["world_size"]),
            str(rec["attempt"]),
            int(rec["size"]),
            str(rec["hash"]),
            table,
            pieces,
        )

    @property
    def label(self) -> str:
        return f"{self.kind} copy of rank {self.shard}'s step {self.step}"


class NodeTier:
    """The fast tier's dir on this node (``root``): write, scan, read, quarantine, prune."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def node_id(self) -> str:
        """This dir's token: the same for every rank that shares it (created by the first one)."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "node.id"
        create_exclusive(path, secrets.token_hex(8).encode())
        return path.read_text().strip()

    def _dir(self, kind: str, shard: int) -> Path:
        return self.root / kind / f"rank_{shard}"

    def paths(self, c: Copy) -> tuple[Path, Path]:
        d = self._dir(c.kind, c.shard)
        return d / f"step_{c.step}.bin", d / f"step_{c.step}.json"

    def write(self, c: Copy, inline: bytes | bytearray | memoryview) -> None:
        """The copy's inline pieces, then its marker (last, after the objects it names: a copy without its marker
        is never offered)."""
        data, marker = self.paths(c)
        data.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(data, inline)  # type: ignore[arg-type]  # any buffer: written through a memoryview
        write_json_atomic(marker, c.marker())

    def object_path(self, h: str) -> Path:
        return self.root / "objects" / f"{h}.bin"

    def has_object(self, h: str, size: int) -> bool:
        try:
            return self.object_path(h).stat().st_size == size
        except OSError:
            return False

    def write_object(self, h: str, data: memoryview) -> bool:
        """An object's bytes under their hash (the caller hashed them); False: this node has it already. A spare
        file of the same size (an object no copy names any more) is overwritten in place when there is one:
        writing into pages the node already has costs half of writing into new ones. Not fsynced, one fsync per
        tensor being what a disk-backed fast dir cannot afford: an object is checked against its name (its hash)
        before any restore uses it, so one torn by a machine crash is quarantined, never loaded."""
        if self.has_object(h, len(data)):
            return False
        path = self.object_path(h)
        path.parent.mkdir(parents=True, exist_ok=True)
        name = f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp = self.take_spare(self.spares(len(data)).get(len(data), []), path.parent, name)
        if tmp is not None:
            overwrite_file(tmp, data, sync=False)
            replace_file(tmp, path, sync=False)
            return True
        write_bytes_atomic(path, data, sync=False)  # type: ignore[arg-type]
        return True

    def spares(self, size: int | None = None) -> dict[int, list[Path]]:
        """The node's spare files (objects no copy names any more, :meth:`collect`) by size (of ``size`` only)."""
        out: dict[int, list[Path]] = {}
        for p in sorted((self.root / "spare").glob(f"{'*' if size is None else size}-*.bin")):
            n = p.name.split("-", 1)[0]
            if n.isdigit():
                out.setdefault(int(n), []).append(p)
        return out

    def take_spare(self, listed: list[Path], dest_dir: Path, name: str) -> Path | None:
        """One of the ``listed`` spares (taken from the list) moved to ``dest_dir/name``: taken, no other writer
        can have it now; one that is not a regular file (a planted link: writing through it would reach outside the
        node dir) is removed. None: another writer of this node took each first, or none was listed."""
        while listed:
            try:
                taken = move_aside(listed.pop(0), dest_dir, name, sync=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(os.lstat(taken).st_mode):
                return taken
            with contextlib.suppress(OSError):
                clear_file(taken)
        return None

    def adopt(self, path: Path, h: str) -> None:
        """A finished file of an object's bytes (a process's snapshot slot, :mod:`.slots`) given its name."""
        dest = self.object_path(h)
        dest.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, dest, sync=False)

    def piece(self, c: Copy, i: int) -> memoryview:
        """Piece ``i`` of a copy, mapped from its file (no copy: it is hashed, sent and loaded as it lies). Its pages
        are mapped in as they are read, or ahead of that by a :class:`~.prefault.Prefault` (the restore's)."""
        n, h, obj = c.parts[i]
        if obj:
            path, skip = self.object_path(h), 0
        else:
            path, skip = self.paths(c)[0], sum(m for m, _, o in c.parts[:i] if not o)
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < skip + n:
                raise OSError(f"{path} is shorter than its marker says")
            mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        return memoryview(mapped)[skip : skip + n]  # read-only: only ever hashed, sent and copied from

    def scan(self) -> tuple[list[Copy], list[tuple[Path, str]]]:
        """Every copy here whose marker is sound and whose data has the size it records, and the files that are
        not (with why). The bytes are hashed where a copy is used (:mod:`.restore`), so each is read once."""
        good: list[Copy] = []
        bad: list[tuple[Path, str]] = []
        for kind in KINDS:
            for rank_dir in sorted(p for p in (self.root / kind).glob("rank_*") if _RANK.match(p.name)):
                for marker in sorted(rank_dir.glob("step_*.json")):
                    m = _STEP.match(marker.name)
                    if m is None:
                        continue
                    why, copy = self._check(marker, kind, int(_RANK.match(rank_dir.name).group(1)), int(m.group(1)))  # type: ignore[union-attr]
                    if copy is not None:
                        good.append(copy)
                    else:
                        bad.append((marker, why))
        return good, bad

    def _check(self, marker: Path, kind: str, shard: int, step: int) -> tuple[str, Copy | None]:
        try:
            c = Copy.of(json.loads(marker.read_bytes()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"unreadable marker ({e})", None
        if (c.kind, c.shard, c.step) != (kind, shard, step):
            return f"marker names the {c.label}, not the {kind} copy of rank {shard}'s step {step}", None
        if not 0 <= c.shard < len(c.table) == c.world_size or c.table[c.shard] != (c.size, c.hash):
            return "marker's own entry disagrees with its table", None
        if sum(n for n, _, _ in c.parts) != c.size or digest_of(c.parts) != c.hash:
            return "marker's pieces disagree with its size or digest", None
        data, inline = marker.with_suffix(".bin"), inline_size(c.parts)
        try:
            size = data.stat().st_size
            if size != inline:
                return f"{size} bytes, the marker says {inline}", None
        except OSError as e:
            return f"its data is unreadable ({e.strerror or e})", None
        for n, h, obj in c.parts:
            if obj and not self.has_object(h, n):
                return f"its object {h} ({n} bytes) is missing here", None
        return "", c

    def quarantine(self, marker: Path, why: str) -> None:
        """Move a copy (marker and data) aside with a note; it is never offered again."""
        dest = self.root / "quarantine"
        name = f"{marker.parent.parent.name}-{marker.parent.name}-{marker.stem}-{time.strftime('%Y%m%dT%H%M%S')}"
        name += f"-{secrets.token_hex(2)}"
        for src in (marker.with_suffix(".bin"), marker):
            with contextlib.suppress(FileNotFoundError):
                move_aside(src, dest, f"{name}{src.suffix}")
        write_json_atomic(dest / f"{name}.why.json", {"why": why, "was": str(marker)})

    def quarantine_object(self, h: str, why: str) -> None:
        """Move an object whose bytes are not what its name says aside, with a note (every copy naming it then
        fails its scan here and is never offered)."""
        dest = self.root / "quarantine"
        name = f"object-{h}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}"
        with contextlib.suppress(FileNotFoundError):
            move_aside(self.object_path(h), dest, f"{name}.bin")
            write_json_atomic(dest / f"{name}.why.json", {"why": why, "was": str(self.object_path(h))})

    def named_objects(self, dirs: list[tuple[str, int]] | None = None) -> dict[str, int]:
        """The objects (hash: size) the markers here name: of the ``(kind, shard)`` dirs given, else of all."""
        out: dict[str, int] = {}
        for kind in KINDS:
            for marker in (self.root / kind).glob("rank_*/step_*.json"):
                if dirs is not None and (kind, _shard_of(marker)) not in dirs:
                    continue
                try:
                    parts = Copy.of(json.loads(marker.read_bytes())).parts
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # unreadable: quarantined at the next restore; nothing of it can be offered
                out.update((h, n) for n, h, obj in parts if obj)
        return out

    def collect(self, protect: set[str], litter: bool = False) -> None:
        """The keeper, while no rank of the node writes an object it does not protect: the objects that no
        marker here names and ``protect`` (what the step being saved names) does not hold become spares (for
        this step's writes to reuse; the spares the last step left unused are removed). ``litter``: remove
        the spares and a dead writer's temp files too (only when no rank writes: at restore)."""
        for p in (self.root / "spare").glob("*.bin"):
            _unlink(p)
        named = set(protect) | set(self.named_objects())
        for p in (self.root / "objects").glob("*"):
            m = _OBJECT.match(p.name)
            if m is None:
                if litter:
                    _unlink(p)
            elif m.group(1) not in named:
                if litter:
                    _unlink(p)
                    continue
                with contextlib.suppress(OSError):
                    move_aside(p, self.root / "spare", f"{p.stat().st_size}-{secrets.token_hex(6)}.bin", sync=False)

    def prune(self, kind: str, shard: int, keep: int) -> None:
        """Keep the newest ``keep`` steps of one writer's dir (only that writer calls this)."""
        d = self._dir(kind, shard)
        steps = sorted((int(m.group(1)) for p in d.glob("step_*.json") if (m := _STEP.match(p.name))), reverse=True)
        for step in steps[keep:]:
            for suffix in (".json", ".bin"):  # the marker first: a copy is never offered without its data
                _unlink(d / f"step_{step}{suffix}")

    def drop_all_but(self, step: int | None) -> None:
        """The keeper, at restore, before any rank saves again: remove every copy not of ``step``."""
        for kind in KINDS:
            for rank_dir in (self.root / kind).glob("rank_*"):
                for marker in rank_dir.glob("step_*.json"):
                    if marker.name != f"step_{step}.json":
                        _unlink(marker)
                        _unlink(marker.with_suffix(".bin"))
                for data in rank_dir.glob("step_*.bin"):  # data whose writer died before its marker
                    if not data.with_suffix(".json").exists():
                        _unlink(data)
        for slots in (self.root / "slots").glob("*"):  # a dead process's snapshot files (:mod:`.slots`)
            with contextlib.suppress(OSError):  # the keeper alone raising here would leave its node-mates waiting
                remove_tree(slots)  # in the restore's next collective; what stays is removed at the next restore
        self.collect(set(), litter=True)

    def held_bytes(self, dirs: list[tuple[str, int]] | None = None) -> int:
        """Bytes of copies here (their own files and the objects they name, each object once): of the
        ``(kind, shard)`` dirs given, else of every dir."""
        total = sum(self.named_objects(dirs).values())
        for kind in KINDS:
            for p in (self.root / kind).glob("rank_*/step_*.bin"):
                if dirs is None or (kind, _shard_of(p)) in dirs:
                    with contextlib.suppress(OSError, ValueError):
                        total += p.stat().st_size
        return total

    def free_bytes(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(self.root).free


def _shard_of(path: Path) -> int:
    return int(path.parent.name[5:])


def _unlink(path: Path) -> None:
    if path.exists():
        clear_file(path)
