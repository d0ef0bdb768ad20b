"""One SeaweedFS filer mounted several times through FUSE (``weed mount``): two "nodes" sharing one filesystem.

Each mount is its own FUSE client, as on two cluster nodes, so the kernel's locks do not span them: flock,
fcntl locks, ``O_EXCL``, ``link`` and ``RENAME_NOREPLACE`` are not exclusive across mounts (see
``/work/shared/reference/multinode-probe.md``). Write-temp, fsync, rename is visible through the other mounts
within milliseconds. Use :func:`shared_filesystem` (or the ``shared_fs`` fixture in ``tests/sharedfs_fixture.py``)
after :func:`skip_reason` says FUSE works here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.s3.server import SERVICE_PIDS, _free_port_pair, weed_binary

INSTALL = Path(__file__).resolve().parents[1] / "scripts" / "fuse" / "install.sh"
READY_S = 60.0
"""Bound on each start-up wait (the server's first writable volume, each mount, the cross-mount probe)."""


@dataclass
class SharedFS:
    mounts: list[Path]
    """Mount points of one filer: ``mounts[i]`` is "node i"'s view of the shared filesystem."""
    filer: str
    """The filer's ``host:port``."""
    root: Path
    pids: list[int] = field(default_factory=list)
    """The weed server's pid, then each mount's (each leads a process group of its own)."""

    def path(self, i: int, rel: str | Path) -> Path:
        """``rel`` as seen through mount ``i``."""
        return self.mounts[i] / rel


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _mount_points() -> list[str]:
    return [_unescape(line.split()[4]) for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or under ``root`` (itself not a mount point) in this process's ``/proc/self/mountinfo``."""
    top = str(root.resolve())
    return [Path(p) for p in _mount_points() if p == top or p.startswith(top + "/")]


def _kernel_refuses_fuse() -> str | None:
    """Why the kernel refuses a FUSE mount (mount(2) with a /dev/fuse fd, as fusermount3 does), or None."""
    libc = ctypes.CDLL(None, use_errno=True)
    with tempfile.TemporaryDirectory(prefix="sharedfs-probe-") as target:
        fd = os.open("/dev/fuse", os.O_RDWR)
        try:
            opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
            if libc.mount(b"sharedfs-probe", target.encode(), b"fuse.sharedfs-probe", 0, opts) != 0:
                return f"the kernel refuses a FUSE mount: {os.strerror(ctypes.get_errno())}"
        finally:
            os.close(fd)  # aborts the connection: nothing can block on the daemon-less mount
        libc.umount2(target.encode(), 2)  # MNT_DETACH
    return None


@functools.cache
def skip_reason() -> str | None:
    """One line saying why FUSE mounts cannot work here (tests skip with it), or None when they can.

    Installs fuse3 with ``scripts/fuse/install.sh`` when ``fusermount3`` is missing. The line starts with the
    piece this machine lacks, in the words ``tests/conftest.py`` sorts skips by: ``no /dev/fuse``, ``not root``
    and ``the kernel refuses`` (a machine that cannot have it), ``missing Debian package fuse3`` (one that can,
    unless it cannot install packages at all), ``missing weed`` (``scripts/setup.sh`` installs it)."""
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse: the kernel's FUSE device is missing (containers need --device /dev/fuse)"
    if os.geteuid() != 0:
        return "not root: mounting one filer twice through FUSE needs root"
    if shutil.which("fusermount3") is None:
        try:
            done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=900, check=False)
            last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            last = re.sub(r"^\[[\w/.-]+\]\s+(\d\d:\d\d:\d\d\s+)?(ERROR:\s+)?", "", last)  # the script's tag, time
        except (OSError, subprocess.SubprocessError) as e:
            last = f"{type(e).__name__}: {e}"
        if shutil.which("fusermount3") is None:
            return f"missing Debian package fuse3 (fusermount3) after scripts/fuse/install.sh: {last}"
    try:
        weed_binary()
    except RuntimeError as e:
        return f"missing weed: {e}"
    try:
        return _kernel_refuses_fuse()
    except OSError as e:
        return f"the kernel refuses a FUSE mount: {type(e).__name__}: {e}"


def _ports(n: int) -> list[int]:
    """``n`` distinct ports p, each with p + 10000 (weed's gRPC port) free, no port of one the other's gRPC."""
    chosen: list[int] = []
    while len(chosen) < n:
        p = _free_port_pair()
        if not {p, p + 10000} & {q + d for q in chosen for d in (0, 10000)}:
            chosen.append(p)
    return chosen


def _wait(what: str, ready: Iterator[bool], log: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + READY_S
    for ok in ready:
        if ok:
            return
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"sharedfs: weed (pid {p.pid}) exited with {p.returncode}: see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"sharedfs: {what} not ready in {READY_S:.0f} s: see {log}")
        time.sleep(0.1)


def _assignable(master: int) -> Iterator[bool]:
    """Yields whether the master hands out a file id yet: the filer port opens before any volume is writable."""
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{master}/dir/assign", timeout=2) as r:  # noqa: S310
                yield b'"fid"' in r.read()
        except OSError:
            yield False


def _mounted(point: Path) -> Iterator[bool]:
    while True:
        yield str(point) in _mount_points()


def _visible(fs: SharedFS) -> Iterator[bool]:
    """Writes a probe file through mount 0 (write temp, fsync, rename); yields whether every mount reads it."""
    name, body = f".sharedfs-probe-{uuid.uuid4().hex}", os.urandom(4096)
    with open(fs.path(0, name + ".tmp"), "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.rename(fs.path(0, name + ".tmp"), fs.path(0, name))
    while True:
        seen = True
        for i in range(1, len(fs.mounts)):
            try:
                seen = seen and fs.path(i, name).read_bytes() == body
            except FileNotFoundError:
                seen = False
        if seen:
            fs.path(0, name).unlink()
        yield seen


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM each process group, SIGKILL what is left after ``grace_s``; wait for every leader."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the group too: a leader that exited may leave children
        p.wait(10)
        SERVICE_PIDS.discard(p.pid)


def _unmount(point: Path) -> None:
    if str(point) not in _mount_points():  # not stat'ing it: a dead FUSE mount answers ENOTCONN, a hung one blocks
        return
    if subprocess.run(["fusermount3", "-u", str(point)], capture_output=True, check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)


@contextlib.contextmanager
def shared_filesystem(root: Path, mounts: int = 2) -> Iterator[SharedFS]:
    """``weed server -filer`` on loopback (data in ``root/weed``) and ``mounts`` FUSE clients of it at
    ``root/mount<i>``, ready when a file renamed in through mount 0 reads back through all others. On exit
    (and on a failed start) every mount is unmounted and every process stopped and waited for."""
    root = root.resolve()
    run = root / "run"
    for d in ["weed", "run", "log", *(f"mount{i}" for i in range(mounts)), *(f"cache{i}" for i in range(mounts))]:
        (root / d).mkdir(parents=True, exist_ok=True)
    sock_dir = run if len(str(run)) < 90 else Path(tempfile.mkdtemp(prefix="sfs-"))  # sun_path holds 107 bytes
    master, volume, filer = _ports(3)
    weed = weed_binary()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    fs = SharedFS(mounts=[root / f"mount{i}" for i in range(mounts)], filer=f"127.0.0.1:{filer}", root=root)

    def start(cmd: list[str], log: Path) -> None:
        logs.append(open(log, "ab"))  # noqa: SIM115 (closed in the finally below)
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logs[-1], stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
        SERVICE_PIDS.add(procs[-1].pid)
        fs.pids.append(procs[-1].pid)

    try:
        server_log = root / "log" / "weed-server.log"
        start([weed, "server", "-filer", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root / 'weed'}",
               f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
               "-master.volumeSizeLimitMB=256", "-volume.max=100", "-volume.preStopSeconds=0",
               f"-filer.localSocket={sock_dir / 'filer.sock'}", "-metricsPort=0", "-master.telemetry=false"],
              server_log)  # fmt: skip
        _wait("weed server (a writable volume)", _assignable(master), server_log, procs)
        for i, point in enumerate(fs.mounts):
            # -localSocket and -cacheDir per mount: their defaults (/tmp/seaweedfs-mount-<hash>.sock, /tmp) collide
            start([weed, "mount", f"-filer={fs.filer}", f"-dir={point}", f"-cacheDir={root / f'cache{i}'}",
                   f"-localSocket={sock_dir / f'mount{i}.sock'}"], root / "log" / f"mount{i}.log")  # fmt: skip
        for i, point in enumerate(fs.mounts):
            _wait(f"FUSE mount {point}", _mounted(point), root / "log" / f"mount{i}.log", procs)
        if mounts > 1:
            _wait("a file written through mount 0, seen through the others", _visible(fs), root / "log", procs)
        yield fs
    finally:
        for point in fs.mounts:
            _unmount(point)
        _stop(procs[1:], grace_s=3.0)  # the FUSE clients exit by themselves once unmounted
        _stop(procs[:1], grace_s=1.0)  # weed server ignores SIGTERM for long: its data is a temp dir anyway
        for point in mounts_under(root):  # a client killed before its unmount leaves a dead mount
            subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)
        for f in logs:
            f.close()
        for kind, port in (("master", master), ("volume", volume), ("filer", filer)):
            Path(f"/tmp/seaweedfs-{kind}-grpc-{port + 10000}.sock").unlink(missing_ok=True)  # weed's fixed paths
        if sock_dir != run:
            shutil.rmtree(sock_dir, ignore_errors=True)
