"""Who commits a checkpoint dir: a committer lease with a fencing epoch, never a lock of the shared filesystem.

Across nodes a shared filesystem gives no mutual exclusion (``flock``, ``O_EXCL``, ``link`` and
``RENAME_NOREPLACE`` each had two winners in 30-45 % of tight cross-node races on a FUSE mount; GPFS, NFS
``local_lock`` and Lustre ``localflock`` report the same). So the committer lease is not a lock. It is a record,
``checkpoints/committer.json`` (in a bucket: ``<root>/committer.json``), that says who commits, since when, and
under which **epoch**:

* A committer starting finds the record. A live holder (heartbeat younger than its lease; on the same host, its
  pid must also still run) refuses the newcomer in one line naming it, unless the newcomer was made the owner by
  something that can give ownership (``takeover``: the scheduler's one committer job of a run, the rank 0 of a
  training job's process group). Otherwise it writes the record with ``epoch + 1`` and its own token.
* The holder renews its heartbeat from a thread and checks the record before every act that changes the
  checkpoints (:meth:`CommitterLease.fence`). A record with a higher ``(epoch, token)`` means it lost: it raises
  :class:`CommitterLost` and stops. A record with a lower one was written by a ghost (a stale holder that came
  back after a partition or a SIGSTOP): the holder writes its own again. The highest ``(epoch, token)`` wins on
  every store, without any lock: two committers started together converge on one.
* On an object store the record is written by compare-and-swap (``If-None-Match`` / ``If-Match``), its
  strongest primitive; on POSIX by write-temp-fsync-rename (a reader on another node may see it torn for a
  moment through a FUSE mount, and reads it again: :mod:`pipeline.storage.settle`).

The lease narrows the window in which two committers act; it does not close it (a holder stopped between its
fence and its act acts once more). What closes it is the protocol: every act a duplicate can perform is
harmless (see :mod:`pipeline.checkpoint.committer`). The epoch is recorded in ``latest``, so a reader can tell
which holder moved it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import xxhash

from pipeline.errors import PipelineError
from pipeline.storage.atomic import json_bytes, write_bytes_atomic
from pipeline.storage.backend import held_elsewhere
from pipeline.storage.integrity import lstat_kind
from pipeline.storage.s3 import Conflict, S3Store
from pipeline.storage.settle import parse_settled

log = logging.getLogger(__name__)

LEASE = "committer.json"
"""The lease record's name inside ``checkpoints/`` (or a bucket root)."""
DEFAULT_LEASE_S = 30.0
"""A holder whose heartbeat is older than this is gone (renewed every fifth of it)."""
SETTLE_S = 0.2
"""How long a new holder waits before reading the record back: a rename is visible on other nodes in ~10 ms."""


class CommitterBusy(PipelineError):
    """Another committer holds these checkpoints (its heartbeat is fresh)."""


class CommitterLost(PipelineError):
    """This committer's lease was taken over (a higher epoch holds it): it stops and acts no more."""

    exit_code = 1


class LeaseStore(Protocol):
    """Where the lease record lives. ``write(data, expect)`` replaces the record whole; a store with
    compare-and-swap refuses (False) when the record is no longer the version ``expect`` names (None: absent)."""

    where: str

    def read(self) -> tuple[bytes | None, str | None]: ...
    def write(self, data: bytes, expect: str | None) -> bool: ...


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

    def rank(self) -> tuple[int, str]:
        """The fencing order: a higher epoch wins; two holders of one epoch (started together) by token."""
        return self.epoch, self.token

    def live(self, now: float) -> bool:
        if self.released or now - self.heartbeat >= self.lease_s:
            return False
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False  # the fast path on one node: its process is gone, whatever its heartbeat says
            except PermissionError:
                pass
        return True

    def describe(self, now: float) -> str:
        job = f", {self.job}" if self.job else ""
        return (
            f"pid {self.pid} on {self.host}{job}, epoch {self.epoch}, heartbeat {max(0.0, now - self.heartbeat):.1f} s "
            "ago"
        )

    @staticmethod
    def parse(data: bytes | None) -> Holder | None:
        """The record, or None when absent or unreadable (a torn or planted record holds nothing)."""
        if data is None:
            return None
        try:
            obj = json.loads(data)
            h = Holder(**obj)
        except (ValueError, TypeError):
            return None
        ok = type(h.epoch) is int and isinstance(h.token, str) and isinstance(h.heartbeat, int | float)
        return h if ok and isinstance(h.host, str) and type(h.pid) is int else None


def scheduler_job() -> str:
    """The job this process runs in, as the scheduler names it (SLURM job, step and restart count)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return ""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return f"slurm job {job}" + (f" (restart {restarts})" if restarts not in ("", "0") else "")


class CommitterLease:
    """This process's claim on one checkpoint dir's commits (see the module docstring)."""

    def __init__(self, store: LeaseStore, lease_s: float = DEFAULT_LEASE_S) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s={lease_s} must be > 0")
        self.store = store
        self.lease_s = lease_s
        self.token = secrets.token_hex(8)
        self.epoch = 0
        self._started = time.time()
        self._mine: Holder | None = None
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> Holder | None:
        return Holder.parse(self.store.read()[0])

    def acquire(self, takeover: bool = False) -> None:
        """Become the holder, or raise :class:`CommitterBusy` naming the live one (``takeover``: fence it)."""
        data, version = self.store.read()
        now = time.time()
        held = Holder.parse(data)
        if held is not None and held.live(now) and not takeover:
            raise CommitterBusy(
                f"another committer holds {self.store.where}: {held.describe(now)}; exactly one commits these "
                f"checkpoints (stop it, or wait {held.lease_s:.0f} s after it stops)"
            )
        self.epoch = (held.epoch if held is not None else 0) + 1
        if held is not None and held.live(now):
            log.warning("taking over the committer lease from %s: epoch %d fences it", held.describe(now), self.epoch)
        try:
            written = self._write(version)
        except FileNotFoundError:  # a rename raced by another node's onto the same name (seen on a FUSE mount)
            written = False
        if not written:
            raise CommitterBusy(f"another committer took {self.store.where} at the same moment: {self._holder_line()}")
        time.sleep(SETTLE_S)
        held = self.current()  # two starting at once: the record that stayed decides, whichever epoch it has
        if held is None or held.token != self.token:
            what = held.describe(time.time()) if held is not None else "a record that vanished"
            raise CommitterBusy(f"another committer took {self.store.where} at the same moment: {what}")
        self._thread = threading.Thread(target=self._beat, name="committer-lease", daemon=True)
        self._thread.start()

    def fence(self, renew: bool = False) -> None:
        """Check that this process still holds the lease; raise :class:`CommitterLost` if a higher epoch took it.
        Called before every act that changes the checkpoints: one read, and a write only when the record is not
        ours (a ghost's) or ``renew`` (the heartbeat) asks for one."""
        with self._lock:
            for _ in range(10):  # a compare-and-swap lost to a concurrent write: look again
                if self._lost is not None:
                    raise CommitterLost(self._lost)
                data, version = self.store.read()
                held = Holder.parse(data)
                if held is not None and held.rank() > (self.epoch, self.token):
                    self._lost = (
                        f"this committer (epoch {self.epoch}, pid {os.getpid()} on {socket.gethostname()}) lost "
                        f"{self.store.where} to {held.describe(time.time())}: it stops and commits nothing more"
                    )
                    raise CommitterLost(self._lost)
                if not renew and held is not None and held.token == self.token and not held.released:
                    return
                if held is not None and held.token != self.token:
                    log.warning(
                        "a stale committer rewrote %s (%s): epoch %d restores it",
                        self.store.where,
                        held.describe(time.time()),
                        self.epoch,
                    )
                if self._write(version):
                    return
            raise CommitterLost(f"{self.store.where} kept changing under 10 compare-and-swap attempts")

    def lost(self) -> str | None:
        return self._lost

    def release(self) -> None:
        """Stop renewing; if the record is still ours, mark it released so the next committer starts at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.lease_s)
        with self._lock:
            if self._lost is not None or self._mine is None:
                return
            data, version = self.store.read()
            held = Holder.parse(data)
            if held is not None and held.token == self.token:
                self._mine = None
                self.store.write(json_bytes(asdict(_released(held))), version)

    # -- internals ------------------------------------------------------------------------------------------

    def _holder(self) -> Holder:
        return Holder(
            epoch=self.epoch,
            token=self.token,
            host=socket.gethostname(),
            pid=os.getpid(),
            job=scheduler_job(),
            started=self._started,
            heartbeat=time.time(),
            lease_s=self.lease_s,
        )

    def _write(self, version: str | None) -> bool:
        mine = self._holder()
        if not self.store.write(json_bytes(asdict(mine)), version):
            return False
        self._mine = mine
        return True

    def _holder_line(self) -> str:
        held = self.current()
        return held.describe(time.time()) if held is not None else "unknown"

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 5):
            try:
                self.fence(renew=True)
            except CommitterLost:  # the committer's next pass says so, once
                return
            except (OSError, PipelineError) as e:  # a store hiccup: the next beat tries again
                log.warning("committer lease heartbeat of %s failed: %s", self.store.where, e)


def _released(h: Holder) -> Holder:
    return Holder(**{**asdict(h), "released": True, "heartbeat": time.time()})


class FileLease:
    """The record as a file of a (shared) filesystem: replaced whole by write-temp-fsync-rename, which every node
    sees whole. There is no compare-and-swap: ``expect`` is not checked (the epoch order decides, see above)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)

    def read(self) -> tuple[bytes | None, str | None]:
        if lstat_kind(self.path) != "file":  # absent, or planted (a link is never followed): no holder
            return None, None
        try:  # a record another node is replacing can read torn through a shared mount: read it again first
            data = parse_settled(self._read, _whole_json, (ValueError,))
        except ValueError:
            data = self._read()  # damaged for good: Holder.parse finds no holder in it
        except OSError:  # gone between the look and the open, or unreadable: no holder to obey
            return None, None
        return data, xxhash.xxh3_64_hexdigest(data)

    def _read(self) -> bytes:
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            return f.read(1 << 16)

    def write(self, data: bytes, expect: str | None) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.path, data)
        return True


def _whole_json(data: bytes) -> bytes:
    json.loads(data)
    return data


def live_holder(checkpoints: Path) -> Holder | None:
    """The committer of ``checkpoints/`` whose heartbeat is fresh, on any node (None: no live one)."""
    held = Holder.parse(FileLease(checkpoints / LEASE).read()[0])
    return held if held is not None and held.live(time.time()) else None


def committer_alive(checkpoints: Path, lock: Path) -> bool:
    """Whether a committer of ``checkpoints/`` runs: the node-local lock held here, or a live lease anywhere."""
    return held_elsewhere(lock) or live_holder(checkpoints) is not None


class ObjectLease:
    """The record as an object: created with ``If-None-Match: *``, replaced with ``If-Match`` on its ETag."""

    def __init__(self, store: S3Store, key: str) -> None:
        self.store = store
        self.key = key
        self.where = store.url(key)

    def read(self) -> tuple[bytes | None, str | None]:
        got = self.store.get(self.key)
        return (None, None) if got is None else got

    def write(self, data: bytes, expect: str | None) -> bool:
        try:
            if expect is None:
                self.store.put(self.key, data, if_none_match=True)
            else:
                self.store.put(self.key, data, if_match=expect)
        except Conflict:
            return False
        return True
