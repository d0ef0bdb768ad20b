"""A SeaweedFS filer mounted twice through FUSE (``tests/sharedfs.py``) whose server can be taken away: SIGKILL of
``weed server`` (master, volume server and filer in one process), then a restart on the same ports and the same
data dir while both ``weed mount`` clients keep running.

What the clients do meanwhile (measured here with weed 4.48 on loopback; ``tests/test_filer_outage.py``): no
remount is needed. Each ``weed mount`` process survives and reconnects by itself (gRPC), resuming its metadata
subscription; both mounts serve again ~1-3 s after the restarted server hands out file ids (~2 s after its
start). Meanwhile a call is either held until the server is back (answered then, whole) or fails with ``EIO``:
a read or an upload in flight against the volume server at the kill fails within 0-5 s; a metadata call
(lookup, listing, ``mkdir``, ``rename``) waits, and fails with ``EIO`` after ~13 s of the client's retries (one
in flight at the kill failed after 8 s although the server was back after 5 s). ``ENOTCONN``/``ECONNABORTED``
appear only when a client itself goes (an unmount), never in these outages. A process in such a call cannot
die (SIGKILL waits for the call to be answered).

The restart adds ``-master.electionTimeout=1s``: a master resuming its one-node raft state (its topology id, the
volume ids) waits its election timeout, 10 s by default, and the raft rounds after it (~20 s in all, answering
``raft.Server: Not current leader``) before it serves, which would make every outage ~20 s longer than the
kill. With it the master leads ~2 s after its start (``-master.resumeState=false`` serves as fast, but starts a
new topology).

After a restart a read can also fail at once, for ~30 s: the filer is up a moment before the volume server has
registered with the master, and a mount that looks a volume up in that moment is told ``volume 7 not found``
(its log: "non-retryable error"), and every read of a file on that volume through that mount fails with ``EIO``
until the mount looks it up again ~30 s later (seen in 2 of ~12 restarts, on one mount of the two).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.s3.server import SERVICE_PIDS
from tests.sharedfs import SharedFS, _assignable, _wait, shared_filesystem

RESTART_FLAGS = ["-master.electionTimeout=1s"]


@dataclass
class Outage:
    killed: float
    """``time.time()`` of the SIGKILL."""
    restarted: float | None = None
    """When the new server was started."""
    serving: float | None = None
    """When its master handed out a file id again (a volume writable)."""


@dataclass
class FilerWithOutages:
    """:class:`~tests.sharedfs.SharedFS` plus :meth:`kill` and :meth:`restart` of its server."""

    fs: SharedFS
    cmd: list[str]
    log: Path
    master: int
    ports: list[int]
    pid: int
    """The running server's pid (the first one's is ``fs.pids[0]``, reaped by ``shared_filesystem``)."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """The servers this object started (each restart)."""
    outages: list[Outage] = field(default_factory=list)
    _logs: list[IO[bytes]] = field(default_factory=list)

    @property
    def down(self) -> bool:
        return bool(self.outages) and self.outages[-1].restarted is None

    def kill(self) -> None:
        """SIGKILL the server (its process group) and wait until it is gone (a zombie holds no port)."""
        assert not self.down, "the server is already down"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.outages.append(Outage(killed=time.time()))
        deadline = time.monotonic() + 10
        while _alive(self.pid):
            assert time.monotonic() < deadline, f"weed server {self.pid} outlived its SIGKILL by 10 s"
            time.sleep(0.01)
        for p in self.procs:
            if p.pid == self.pid:
                p.wait(10)
                SERVICE_PIDS.discard(p.pid)

    def restart(self) -> float:
        """Start the server again on the same ports and data dir; returns once it serves (its seconds)."""
        assert self.down, "the server is running"
        _unlink_sockets(self.ports)  # weed's fixed unix-socket paths: a killed server leaves its own behind
        for arg in self.cmd:
            if arg.startswith("-filer.localSocket="):
                Path(arg.split("=", 1)[1]).unlink(missing_ok=True)
        self._logs.append(open(self.log, "ab"))  # noqa: SIM115 (closed by the context manager)
        self._logs[-1].write(f"\n=== restarted by tests/filer_outages.py at {time.time():.3f} ===\n".encode())
        self._logs[-1].flush()
        proc = subprocess.Popen([*self.cmd, *RESTART_FLAGS], stdin=subprocess.DEVNULL, stdout=self._logs[-1],
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        SERVICE_PIDS.add(proc.pid)
        self.procs.append(proc)
        self.pid = proc.pid
        t0 = time.monotonic()
        self.outages[-1].restarted = time.time()
        _wait("the restarted weed server (a writable volume)", _assignable(self.master), self.log, [proc])
        self.outages[-1].serving = time.time()
        return time.monotonic() - t0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _unlink_sockets(ports: list[int]) -> None:
    for port in ports:
        for kind in ("master", "volume", "filer"):
            Path(f"/tmp/seaweedfs-{kind}-grpc-{port + 10000}.sock").unlink(missing_ok=True)


def _flag(cmd: list[str], name: str) -> int:
    return int(next(a for a in cmd if a.startswith(f"-{name}=")).split("=", 1)[1])


@contextlib.contextmanager
def filer_with_outages(root: Path, mounts: int = 2) -> Iterator[FilerWithOutages]:
    """:func:`tests.sharedfs.shared_filesystem` whose server can be killed and restarted. On exit the mounts are
    unmounted first (by ``shared_filesystem``), then every server this started is stopped."""
    restartable: FilerWithOutages | None = None
    try:
        with shared_filesystem(root, mounts) as fs:
            with open(f"/proc/{fs.pids[0]}/cmdline", "rb") as f:
                cmd = [a.decode() for a in f.read().split(b"\0") if a]
            ports = [_flag(cmd, f"{kind}.port") for kind in ("master", "volume", "filer")]
            restartable = FilerWithOutages(fs, cmd, fs.root / "log" / "weed-server.log", ports[0], ports, fs.pids[0])
            try:
                yield restartable
            finally:
                if restartable.down:  # the mounts unmount cleanly only with their filer back
                    with contextlib.suppress(RuntimeError):
                        restartable.restart()
    finally:
        if restartable is not None:
            for p in restartable.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
                SERVICE_PIDS.discard(p.pid)
            _unlink_sockets(restartable.ports)
            for f in restartable._logs:
                f.close()
