"""Who commits a checkpoint dir: a committer lease with a fencing epoch, never a lock of the shared filesystem.

Across nodes a shared filesystem gives no mutual exclusion (``flock``, ``O_EXCL``, ``link`` and
``RENAME_NOREPLACE`` each had two winners in 30-45 % of tight cross-node races on a FUSE mount; GPFS, NFS
``local_lock`` and Lustre ``localflock`` report the same). So the committer lease is not a lock. It is a set of
records, one per holder, under a name nobody else writes: ``checkpoints/committer/epoch-<E>-<token>.json`` (in a
bucket: ``<root>/committer/...``). The highest ``(epoch, token)`` is the holder; every record says who (host,
pid, job), since when, and carries a heartbeat.

* **Acquiring** is the only act that makes a record: ``epoch`` one above every record listed, under its own new
  name. A newcomer that was not appointed (``takeover``: the scheduler's one committer job of a run, the rank 0 of
  a training job's process group) first judges the holder: free when its record says ``released`` or its process
  is gone from this very machine (same boot and pid namespace); otherwise it watches the record on its *own*
  monotonic clock and takes over only when the record did not change for a whole lease. A holder that renews is
  refused one line naming it. Clocks of different nodes are never compared. After a settle pause it lists again
  (:meth:`CommitterLease._confirm`): its record must be the highest, and one not appointed yields to a record of
  its own epoch that has renewed (its judgement rested on a stale listing). A new holder renews once at once, so a
  newcomer that missed its record yields to it.
* **Holding**: the holder rewrites only its own record (the heartbeat, from a thread) and checks the records before
  every act that changes the checkpoints (:meth:`CommitterLease.fence`). It has lost when a higher record exists,
  when its own record is gone, or when the records cannot be listed (the lease fails closed: unreadable is lost,
  never free). It also stops on its own timer: once its last renewal is older than :data:`STOP_AT` of its lease,
  it acts no more, so by the time a watcher takes over (a whole lease unchanged) it has stopped. A fence that
  finds the heartbeat overdue renews (a heartbeat thread starved on a busy node does not stop the holder).
* A ghost's late write (a heartbeat, a release) lands on its own record, below the newer holder's: harmless.

The lease narrows the window in which two committers act; it does not close it (a holder frozen between its fence and
its act acts once more when it thaws). What closes it is the protocol: every act a ghost can perform late is harmless
(see :mod:`pipeline.checkpoint.protocol.committer`). The epoch is recorded in ``latest``, so a reader can tell which
holder moved it. ``live_holder`` and :meth:`Holder.live` (status, a resume deciding whether to wait) judge by the
heartbeat's age and are advice only; exclusion never rests on them.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, replace

from pipeline.checkpoint.protocol import lease_records
from pipeline.checkpoint.protocol.lease_records import (
    HELD,
    FileLease,
    Holder,
    LeaseStore,
    ObjectLease,
    newest_holder,
    ranked,
    record_name,
)
from pipeline.errors import PipelineError
from pipeline.storage.atomic import json_bytes

log = logging.getLogger(__name__)

__all__ = ["CommitterBusy", "CommitterLease", "CommitterLost", "FileLease", "Holder", "LeaseStore", "ObjectLease"]

LEASE = "committer"
"""The lease records' folder inside ``checkpoints/`` (or a bucket root)."""
DEFAULT_LEASE_S = 30.0
"""A record unchanged for this long (on the watcher's clock) belongs to a holder that is gone; renewed every
fifth of it."""
STOP_AT = 0.7
"""A holder whose last renewal is older than this fraction of its lease stops acting (its own timer)."""
SETTLE_S = 0.2
"""How long a new holder waits before listing the records again: a write is visible on other nodes in ~10 ms."""


class CommitterBusy(PipelineError):
    """Another committer holds these checkpoints (its record changes: it renews)."""


class CommitterLost(PipelineError):
    """This committer's lease was taken over (a higher epoch holds it), cannot be read, or was not renewed in
    time: it stops and acts no more."""

    exit_code = 1


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
        self._renewed = 0.0  # monotonic time of the fence before this holder's last renewal that landed
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return record_name(self.epoch, self.token)

    def current(self) -> Holder | None:
        return newest_holder(self.store)

    def acquire(self, takeover: bool = False) -> None:
        """Become the holder, or raise :class:`CommitterBusy` naming the live one (``takeover``: fence it)."""
        try:
            records = ranked(self.store)
            if records and not takeover:
                self._judge(records[-1][2])
                records = ranked(self.store)
        except (OSError, PipelineError) as e:
            if isinstance(e, CommitterBusy):
                raise
            raise CommitterBusy(f"cannot read the committer lease {self.store.where}: {e}; not taking it") from None
        self.epoch = max((r[0] for r in records), default=0) + 1
        if records and takeover:
            held = self.current()
            if held is not None and not held.released:
                log.warning("taking over the committer lease from %s: epoch %d fences it", held.describe(time.time()),
                            self.epoch)  # fmt: skip
        self._write_and_confirm(takeover)
        renewed = time.monotonic()
        # Beat 1, at once: a newcomer of this epoch whose listing missed this record yields to it. An I/O error
        # here fails the acquisition in one line, as every other write of it does.
        if self._write():
            self._renewed = renewed
        for epoch, _, name in records:  # fenced by this record: their holders stop at their next fence
            if epoch < self.epoch:
                self.store.delete(name)  # an I/O error fails the acquisition in one line, as every other does
        try:  # paused since the confirmation (a ghost already), this newcomer may have been fenced: not admitted
            self.fence()
        except CommitterLost as e:  # its record stays: removing the highest one would take the epoch back
            raise CommitterBusy(f"not taking the committer lease {self.store.where}: {e}") from None
        HELD.add(self.token)
        self._thread = threading.Thread(target=self._beat, name="committer-lease", daemon=True)
        self._thread.start()

    def _write_and_confirm(self, takeover: bool) -> None:
        """Write this holder's first record, settle, confirm it (an appointed holder whose epoch proves taken by a
        stale view tries the next epoch, up to three times)."""
        for _ in range(3):
            checked = time.monotonic()
            try:
                written = self._write()
            except FileNotFoundError:  # the records' folder raced by another node's first write (a FUSE mount)
                written = False
            if not written:
                raise CommitterBusy(f"another committer took {self.store.where} at the same moment: {self._top_line()}")
            self._renewed = checked
            time.sleep(SETTLE_S)
            if self._confirm(takeover):
                return
        raise CommitterBusy(f"the committer lease {self.store.where} kept changing under this acquisition")

    def _confirm(self, takeover: bool) -> bool:
        """After the settle pause: this record must be the highest (two started at once: the token orders them);
        one that was not appointed also yields to a record of a higher epoch, or of its own epoch that has renewed
        (its judgement rested on a listing that missed a holder: a stale view of a shared mount). An appointed one
        that finds, at the highest epoch, its own and another record of it that has renewed (whatever their tokens)
        chose that epoch from such a view: it must fence every record, so it drops its own and returns False (the
        caller writes the next epoch); True: confirmed. Two started at once (no renewal yet) stay ordered by token."""
        try:
            records = ranked(self.store)
        except (OSError, PipelineError) as e:
            raise CommitterBusy(f"cannot read the committer lease {self.store.where} back: {e}") from None
        if (
            takeover
            and records
            and records[-1][0] == self.epoch
            and any(r[0] == self.epoch and self._renewed_before(r[2]) for r in records if r[1] != self.token)
        ):
            self._drop_own()  # the other record of this epoch keeps the epoch where it is
            self.epoch += 1
            return False
        if not records or (records[-1][0], records[-1][1]) != (self.epoch, self.token):
            raise CommitterBusy(f"another committer took {self.store.where} at the same moment: {self._top_line()}")
        if not takeover and any(r[0] > self.epoch or (r[0] == self.epoch and self._renewed_before(r[2]))
                                for r in records if r[1] != self.token):  # fmt: skip
            self._drop_own()
            raise CommitterBusy(f"another committer holds {self.store.where} at epoch {self.epoch}: not taking it")
        return True

    def _renewed_before(self, name: str) -> bool:
        """Whether the record ``name`` of this epoch has renewed at least once: it held the lease before this one
        (missed by a stale listing), not a newcomer started at the same moment (which only the token orders)."""
        held = Holder.parse(_get_or_none(self.store, name))
        return held is None or held.beat > 0

    def _judge(self, name: str) -> None:
        """The holder of record ``name``: return when it is gone; raise :class:`CommitterBusy` while it renews
        (its record changes within a lease, on this process's own clock)."""
        first = self.store.get(name)
        held = Holder.parse(first)
        if held is not None and (held.released or held.gone_here()):
            return
        start = time.monotonic()  # a process that runs may still be frozen (SIGSTOP): only its record tells
        while time.monotonic() - start < self.lease_s:
            time.sleep(min(self.lease_s / 10, 1.0))
            top = ranked(self.store)
            if not top:
                return
            data = self.store.get(top[-1][2])
            if top[-1][2] != name or data != first:
                now = Holder.parse(data)
                if now is not None and (now.released or now.gone_here()):
                    return
                raise self._busy(now if now is not None else held)
        log.warning("the committer lease %s did not change for %.0f s: its holder is gone", self.store.where,
                    self.lease_s)  # fmt: skip

    def _busy(self, held: Holder | None) -> CommitterBusy:
        who = held.describe(time.time()) if held is not None else "a holder whose record cannot be read"
        return CommitterBusy(
            f"another committer holds {self.store.where}: {who}; exactly one commits these checkpoints (stop it, "
            f"or wait {self.lease_s:.0f} s after it stops)"
        )

    def fence(self, renew: bool = False) -> None:
        """Check that this process still holds the lease, or raise :class:`CommitterLost`: a higher record
        exists, its own record is gone, the records cannot be listed, or its last renewal is too old (its own
        timer). Called before every act that changes the checkpoints. ``renew`` (the heartbeat) rewrites its
        own record, and only that."""
        with self._lock:
            if self._lost is not None:
                raise CommitterLost(self._lost)
            checked = time.monotonic()
            age = checked - self._renewed
            try:
                records = ranked(self.store)
            except (OSError, PipelineError) as e:
                self._lose(f"cannot read the lease ({e}); it fails closed")
            higher = [r for r in records if (r[0], r[1]) > (self.epoch, self.token)]
            if higher:
                held = Holder.parse(_get_or_none(self.store, higher[-1][2]))
                who = held.describe(time.time()) if held is not None else f"epoch {higher[-1][0]}"
                self._lose(f"lost it to {who}")
            if not any(r[2] == self.name for r in records):
                self._lose("its own lease record is gone")
            if age > self.lease_s * STOP_AT:
                self._lose(f"its last lease renewal was {age:.1f} s ago (lease {self.lease_s:g} s): another may take "
                           "over now")  # fmt: skip
            if renew or age > self.lease_s / 5:  # the heartbeat, or a fence that finds it overdue (a starved thread)
                try:
                    if self._write():
                        self._renewed = checked
                except (OSError, PipelineError) as e:  # a missed beat: the next one tries again (its timer runs)
                    log.warning("committer lease heartbeat of %s failed: %s", self.store.where, e)

    def _lose(self, why: str) -> None:
        HELD.discard(self.token)
        self._lost = (
            f"this committer (epoch {self.epoch}, pid {os.getpid()} on {socket.gethostname()}) no longer holds "
            f"{self.store.where}: {why}; it stops and commits nothing more"
        )
        raise CommitterLost(self._lost)

    def lost(self) -> str | None:
        return self._lost

    def release(self) -> None:
        """Stop renewing; mark this holder's own record released, so the next committer starts at once."""
        self._stop.set()
        HELD.discard(self.token)
        if self._thread is not None:
            self._thread.join(self.lease_s)
        with self._lock:
            if self._lost is not None or self._mine is None:
                return
            mine, self._mine = self._mine, None
            released = replace(mine, released=True, heartbeat=time.time())
            self.store.put(self.name, json_bytes(asdict(released)), create=False)  # its own record only

    # -- internals ------------------------------------------------------------------------------------------

    def _write(self) -> bool:
        beat = self._mine.beat + 1 if self._mine is not None else 0
        mine = Holder(
            epoch=self.epoch,
            token=self.token,
            host=socket.gethostname(),
            pid=os.getpid(),
            job=lease_records.scheduler_job(),
            started=self._started,
            heartbeat=time.time(),
            lease_s=self.lease_s,
            machine=lease_records.machine_id(),
            pid_start=lease_records.process_start(os.getpid()) or 0,
            beat=beat,
        )
        if not self.store.put(self.name, json_bytes(asdict(mine)), create=self._mine is None):
            return False
        self._mine = mine
        return True

    def _drop_own(self) -> None:
        self._mine = None
        try:
            self.store.delete(self.name)
        except (OSError, PipelineError) as e:
            log.debug("own lease record %s stays: %s", self.name, e)

    def _top_line(self) -> str:
        held = self.current()
        return held.describe(time.time()) if held is not None else "unknown"

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 5):
            try:
                self.fence(renew=True)
            except CommitterLost:  # the committer's next fence says so, once
                return


def _get_or_none(store: LeaseStore, name: str) -> bytes | None:
    try:
        return store.get(name)
    except (OSError, PipelineError):
        return None
