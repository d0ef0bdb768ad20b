"""The committer lease's records (:mod:`pipeline.checkpoint.protocol.ownership`): one per holder, named
``epoch-<E>-<token>.json`` and written only by its holder, saying who holds (host, pid, job, the machine its pid
is valid on) with a heartbeat; and where they live: a folder of a (shared) filesystem, or a prefix of a bucket."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.errors import PipelineError
from pipeline.storage.atomic import clear_file, write_bytes_atomic
from pipeline.storage.integrity import is_real_dir, lstat_kind
from pipeline.storage.s3 import Conflict, S3Store
from pipeline.storage.settle import parse_settled

HELD: set[str] = set()
"""Tokens of the leases this process holds now (an in-process committer that crashed holds none)."""
_NAME = re.compile(r"^epoch-(\d{8})-([0-9a-f]{1,64})\.json$")


def record_name(epoch: int, token: str) -> str:
    return f"epoch-{epoch:08d}-{token}.json"


def parse_name(name: str) -> tuple[int, str] | None:
    m = _NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


class LeaseStore(Protocol):
    """Where the lease records live: one record per holder, each written only by its holder. ``names()`` and
    ``get()`` raise (``OSError``, a store error) when they cannot tell; ``put(create=True)`` makes a record only
    where none is (False otherwise)."""

    where: str

    def names(self) -> list[str]: ...
    def get(self, name: str) -> bytes | None: ...
    def put(self, name: str, data: bytes, create: bool) -> bool: ...
    def delete(self, name: str) -> None: ...


@dataclass(frozen=True)
class Holder:
    """One committer's lease record."""

    epoch: int
    token: str
    host: str
    pid: int
    job: str
    started: float
    heartbeat: float
    lease_s: float
    released: bool = False
    machine: str = ""
    """The boot and pid namespace its pid is valid in (see :func:`machine_id`)."""
    pid_start: int = 0
    """Its process's start time (clock ticks since boot), so a reused pid is not taken for it."""
    beat: int = 0
    """Renewals so far: every heartbeat changes the record, which is how a watcher tells it lives."""

    def rank(self) -> tuple[int, str]:
        """The fencing order: a higher epoch wins; two holders of one epoch (started together) by token."""
        return self.epoch, self.token

    def gone_here(self) -> bool:
        """Its process is known gone: it ran on this very machine (boot and pid namespace) and is not running."""
        if not self.machine or self.machine != machine_id():
            return False
        if self.pid == os.getpid():  # this very process: gone unless one of its leases still holds that record
            return self.token not in HELD
        start = process_start(self.pid)
        return start is None or bool(start and self.pid_start and start != self.pid_start)  # 0: not known

    def live(self, now: float) -> bool:
        """Advice for one look (status): not released, not gone from this machine, and a heartbeat younger than
        its lease by this machine's clock, which compares two nodes' clocks: a holder whose clock is behind by
        more than its lease looks dead. A caller that polls judges by :class:`Watch` instead. Exclusion never
        rests on either."""
        if self.released or self.gone_here():
            return False
        return now - self.heartbeat < self.lease_s

    def describe(self, now: float) -> str:
        job = f", {self.job}" if self.job else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started)) if self.started else "?"
        return (
            f"pid {self.pid} on {self.host}{job}, since {since}, epoch {self.epoch}, heartbeat "
            f"{max(0.0, now - self.heartbeat):.1f} s ago"
        )

    @staticmethod
    def parse(data: bytes | None) -> Holder | None:
        """The record, or None when absent or unreadable (a torn or planted record)."""
        if data is None:
            return None
        try:
            obj = json.loads(data)
            h = Holder(**obj)
        except (ValueError, TypeError):
            return None
        ok = type(h.epoch) is int and isinstance(h.token, str) and isinstance(h.heartbeat, int | float)
        return h if ok and isinstance(h.host, str) and type(h.pid) is int else None


class Watch:
    """Whether a lease holder lives, judged by a caller that polls (a resume waiting for a commit, a job's close)
    on its *own* monotonic clock, never by comparing its wall clock with the holder's: alive while the holder's
    record changed (each renewal does) within the holder's lease of this observer's time. The first look gives
    the benefit of the doubt for one lease; a record released, or whose process is gone from this very machine,
    is dead at once. Advice only (how long to wait), as :meth:`Holder.live`; exclusion never rests on it.
    Keep one per poll loop (per store)."""

    def __init__(self) -> None:
        self._seen: tuple[object, ...] | None = None
        self._since = 0.0

    def live(self, held: Holder | None) -> bool:
        now = time.monotonic()
        if held is None or held.released or held.gone_here():
            self._seen = None
            return False
        mark = (held.epoch, held.token, held.beat, held.heartbeat)
        if mark != self._seen:
            self._seen, self._since = mark, now
        return now - self._since < held.lease_s


def machine_id() -> str:
    """This kernel's boot and this process's pid namespace: where a recorded pid means this machine's process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields and fields[0] in ("Z", "X"):
        return None  # a zombie (killed, not reaped yet) runs no more
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0


def scheduler_job() -> str:
    """The job this process runs in, as the scheduler names it (SLURM job, step and restart count)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return ""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return f"slurm job {job}" + (f" (restart {restarts})" if restarts not in ("", "0") else "")


def ranked(store: LeaseStore) -> list[tuple[int, str, str]]:
    """Every record's ``(epoch, token, name)``, lowest first (names only: nothing read). Raises when the records
    cannot be listed."""
    out = []
    for name in store.names():
        parsed = parse_name(name)
        if parsed is not None:
            out.append((*parsed, name))
    return sorted(out)


def newest_holder(store: LeaseStore) -> Holder | None:
    """The highest record, read (None: none, or it cannot be read now). For display and advice."""
    try:
        top = ranked(store)
        return Holder.parse(store.get(top[-1][2])) if top else None
    except (OSError, PipelineError):
        return None


class FileLease:
    """The records as files of one (shared) filesystem folder, each replaced whole by write-temp-fsync-rename by
    its one writer. Nothing is ever followed through a link."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.where = str(folder)

    def names(self) -> list[str]:
        if lstat_kind(self.folder) is None:
            return []
        if not is_real_dir(self.folder):
            raise OSError(f"{self.folder} is not a directory (a link or file planted there)")
        return sorted(os.listdir(self.folder))

    def get(self, name: str) -> bytes | None:
        path = self.folder / name
        if lstat_kind(path) != "file":
            return None
        try:  # a record its holder is replacing can read torn through a shared mount: read it again first
            return parse_settled(lambda: self._read(path), _whole_json, (ValueError,))
        except ValueError:
            return self._read(path)  # damaged for good: Holder.parse finds no holder in it
        except FileNotFoundError:
            return None

    @staticmethod
    def _read(path: Path) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            return f.read(1 << 16)

    def put(self, name: str, data: bytes, create: bool) -> bool:
        path = self.folder / name
        if create and lstat_kind(path) is not None:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, data)
        return True

    def delete(self, name: str) -> None:
        clear_file(self.folder / name)


def _whole_json(data: bytes) -> bytes:
    json.loads(data)
    return data


class ObjectLease:
    """The records as objects under ``<root>/committer/``: each created with ``If-None-Match: *`` and then
    rewritten only by its holder."""

    def __init__(self, store: S3Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/") + "/"
        self.where = store.url(self.prefix)

    def names(self) -> list[str]:
        return sorted(k[len(self.prefix) :] for k in self.store.listing(self.prefix))

    def get(self, name: str) -> bytes | None:
        got = self.store.get(self.prefix + name)
        return None if got is None else got[0]

    def put(self, name: str, data: bytes, create: bool) -> bool:
        try:
            self.store.put(self.prefix + name, data, if_none_match=create)
        except Conflict:
            return False
        return True

    def delete(self, name: str) -> None:
        self.store.delete([self.prefix + name])
