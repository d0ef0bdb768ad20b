"""The node-local tier's files: every copy written by its one owner, verified before anything uses it.

Under ``<fast dir>/<run key>/`` (a RAM-backed dir by default, one per node):

* ``own/rank_K/step_N.{bin,json}``: rank ``K``'s shard of step ``N``, written by the process that is rank ``K``;
* ``replica/rank_K/step_N.{bin,json}``: a replica of rank ``K``'s shard, written by ``K``'s peer on this node;
* ``quarantine/``: copies that failed verification, moved aside with a note, never offered again;
* ``node.id``: a token created once (``O_EXCL`` on the node's own filesystem), which tells the ranks sharing
  this dir apart from those of other nodes; the lowest rank sharing it is the dir's *keeper* (it scans,
  quarantines and prunes what earlier launches left).

The ``.json`` marker is written last (atomically): the step, whose shard, the world size, the launch's attempt,
the blob's size and xxh3-128, and the table of every rank's size and hash for the step (gathered before any copy
is written), so any copy can be checked against what the other holders recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from pipeline.storage.atomic import clear_file, create_exclusive, move_aside, write_bytes_atomic, write_json_atomic

KINDS = ("own", "replica")
_STEP = re.compile(r"^step_(\d+)\.json$")
_RANK = re.compile(r"^rank_(\d+)$")


def digest(blob: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128(blob).hexdigest()


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
        }

    @classmethod
    def of(cls, rec: Any) -> Copy:
        table = tuple((int(s), str(h)) for s, h in rec["table"])
        return cls(
            int(rec["step"]),
            int(rec["shard"]),
            str(rec["kind"]),
            int(rec["world_size"]),
            str(rec["attempt"]),
            int(rec["size"]),
            str(rec["hash"]),
            table,
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

    def write(self, c: Copy, blob: bytes | bytearray | memoryview) -> None:
        """The blob, then its marker (last): a copy without its marker is never offered."""
        data, marker = self.paths(c)
        data.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(data, blob)  # type: ignore[arg-type]  # any buffer: written through a memoryview
        write_json_atomic(marker, c.marker())

    def read(self, c: Copy) -> bytearray:
        """A copy's bytes, read straight into one buffer (which a send or :func:`.codec.unpack` wraps without
        copying)."""
        path = self.paths(c)[0]
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            view, done = memoryview(buf), 0
            while done < len(buf) and (n := f.readinto(view[done:])):
                done += n
        return buf if done == len(buf) else buf[:done]

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
        data = marker.with_suffix(".bin")
        try:
            size = data.stat().st_size
            if size != c.size:
                return f"{size} bytes, the marker says {c.size}", None
        except OSError as e:
            return f"its data is unreadable ({e.strerror or e})", None
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

    def held_bytes(self, dirs: list[tuple[str, int]] | None = None) -> int:
        """Bytes of copies here: of the ``(kind, shard)`` dirs given, else of every dir."""
        total = 0
        for kind in KINDS:
            for p in (self.root / kind).glob("rank_*/step_*.bin"):
                if dirs is None or (kind, int(p.parent.name[5:])) in dirs:
                    with contextlib.suppress(OSError, ValueError):
                        total += p.stat().st_size
        return total

    def free_bytes(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(self.root).free


def _unlink(path: Path) -> None:
    if path.exists():
        clear_file(path)
