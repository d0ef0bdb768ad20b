"""Reads that fail, as a shared filesystem's and a bucket's do (issue 48): every read the protocol makes is a place
where a schedule may inject a fault, on both stores.

Where the real code reads (its choke points, each seen through the module that calls it):

* POSIX records (markers, manifests, ``latest``, the retention record, the lease's records): ``os.open``,
  ``os.fstat`` and ``os.fdopen`` as :mod:`pipeline.storage.integrity` (``_read_record_once``: every record read),
  :mod:`pipeline.checkpoint.stores.repair` (``read_or_none``) and the lease's records module see them;
* POSIX data files and every hash of a file (``hash_file``: data, a manifest's hash, ``latest``'s version):
  ``open`` as :mod:`pipeline.storage.integrity` sees it;
* POSIX metadata (``os.lstat``, ``os.listdir``, ``os.scandir`` of integrity, :mod:`pipeline.storage.reads`, the
  backend, repair): too many to be points of their own, they meet the bursts a point started;
* a bucket: every GET, HEAD and LIST of :class:`tests.sim.memory_s3.MemoryS3`.

A committer's read of a record (``read record PATH``) and a bucket request are points of the scheduler; there
(:meth:`World.inject`) the schedule may start the faults below. A file hashed (``read data PATH``: a step's data,
or a record's hash) and a request a pool's thread makes (run aside) are no points (many per act, or no actor), but
a burst may begin there too (:meth:`World.draw_aside`).

* a **burst** of failed reads: ``EIO`` of the process's whole mount or ``ESTALE`` of one path (POSIX), a 5xx of
  one key or a timeout of every request (a bucket). Every read of that process it covers fails until it ends at
  a virtual time or after :data:`BURST_TRIES` failed reads, whichever comes first (a pool's work, run aside, sees
  no time pass). Its length is one of :data:`BURST_S`, the longest past the retries' budget
  (:data:`pipeline.storage.reads.READ_RETRY_S`): some bursts are outlasted, others are not;
* a **torn** read of a record (its bytes and its size cut: a record that does not parse) or a **short** one (the
  bytes cut, the size whole), for one of :data:`TEAR_S` of virtual time: a re-read then gets it whole, as the
  FUSE mounts measured did within a second.

The writer's own reads (a rank's) and the simulation's looks meet no fault; the restarted trainer's resume does.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.storage.s3_probe import StoreReadFailed

if TYPE_CHECKING:
    from tests.sim.world import World

BURST_S = (0.0, 1.0, 4.0, 25.0)
"""How long a burst of failed reads lasts (0: the one read it began at), in virtual seconds."""
BURST_TRIES = 60
"""A burst also ends after this many failed reads (aside, in a pool's work, no virtual time passes)."""
TEAR_S = (0.0, 0.3, 1.0)
"""How long a record reads torn or short (0: the one read it began at)."""
TEAR_TRIES = 4
S3_READS = ("s3.get", "s3.head", "s3.list")
RECORD_AT = "read record "
DATA_AT = "read data "
READ_POINTS = (RECORD_AT, DATA_AT, *S3_READS, "lease.get", "lease.names")
"""Points where a burst may begin."""


@dataclass
class Burst:
    err: str  # EIO | ESTALE | 5xx | timeout
    until: float
    path: str | None  # None: every read of the process (its mount, its connection)
    tries: int
    fresh: bool = True  # the read it begins at fails, whatever its length
    skip: int = 0  # reads it lets through first (a directed plan's: the Nth read of a path fails)
    only: str | None = None  # only reads of this kind (record, data, meta; a directed plan's), else every one

    def covers(self, path: str, now: float, what: str) -> bool:
        if self.tries <= 0 or not (self.fresh or now < self.until) or self.path not in (None, path):
            return False
        if self.only not in (None, what):
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        return True


@dataclass
class Tear:
    until: float
    short: bool
    tries: int
    fresh: bool = True


def burst_errors(at: str) -> tuple[str, ...]:
    """The errors a burst that begins at ``at`` may be: a bucket's (one key's 5xx, a timeout of every request), a
    mount's (``EIO`` of everything, ``ESTALE`` of one path), or the lease's (its store's, whichever)."""
    if at.startswith(S3_READS):
        return ("5xx", "timeout")
    return ("EIO", "ESTALE")


class ReadFaults:
    """The bursts and tears of one world, and the reads that meet them."""

    def __init__(self, world: World) -> None:
        self.w = world
        self.bursts: dict[str, list[Burst]] = {}
        self.tears: dict[tuple[str, str], Tear] = {}

    # -- begun by the schedule (World.inject) --------------------------------------------------------------------

    def begin_burst(
        self, proc: str, err: str, length_s: float, path: str | None, skip: int = 0, only: str | None = None
    ) -> None:
        """``skip``, ``only``: a directed plan's (the ``skip+1``-th read of ``path``, of kind ``only``, fails)."""
        tries = 1 if length_s <= 0 else BURST_TRIES
        burst = Burst(err, self.w.kernel.now + length_s, path, tries, skip=skip, only=only)
        self.bursts.setdefault(proc, []).append(burst)

    def begin_tear(self, proc: str, path: str, length_s: float, short: bool) -> None:
        tries = 1 if length_s <= 0 else TEAR_TRIES
        self.tears[(proc, path)] = Tear(self.w.kernel.now + length_s, short, tries)

    # -- met by the reads ----------------------------------------------------------------------------------------

    def _reader(self) -> Any:
        a = self.w.kernel.owner()
        if a is None or (a.proc.name == "writer" and not self.w.resuming):
            return None
        return a

    def read(self, what: str, path: str) -> Tear | None:
        """A read of a ``record`` or of ``data`` at ``path`` by whoever runs now: a point of the scheduler (where a
        fault may begin), then the bursts it meets; a record's read may come back torn or short (the Tear)."""
        a = self._reader()
        if a is None:
            return None
        at = f"read {what} {path}"
        if self.w.faults_off:  # no fault begins (a directed plan's, or the rerun): one begun before still counts
            pass
        elif what == "record" and self.w.kernel.current() is a:
            self.w.kernel.point(at)  # World.inject begins a burst or a tear here
        else:  # a file hashed (a pool's read, or many per act): no point, a burst may still begin here
            self.w.draw_aside(a, at)
        self.meet(a.proc.name, path, "posix", what)
        if what != "record":
            return None
        tear = self.tears.get((a.proc.name, path))
        if tear is None or tear.tries <= 0 or not (tear.fresh or self.w.kernel.now < tear.until):
            return None
        tear.tries -= 1
        tear.fresh = False
        return tear

    def meta(self, path: Any) -> None:
        """A look at metadata (lstat, a listing): no point, but a burst covering it fails it."""
        if not self.bursts:
            return
        a = self._reader()
        if a is not None:
            self.meet(a.proc.name, os.fspath(path) if not isinstance(path, int) else "", "posix", "meta")

    def s3(self, op: str, key: str) -> None:
        """A bucket request (after its point): a request run aside (a pool's transfer) may begin a burst here; a
        burst covering it fails it as the real client fails once its own retries are spent
        (:class:`StoreReadFailed`)."""
        a = self._reader()
        if a is None:
            return
        if self.w.kernel.current() is not a:
            self.w.draw_aside(a, f"{op} {key}")
        self.meet(a.proc.name, key, op, "record")

    def meet(self, proc: str, path: str, op: str, what: str) -> None:
        now = self.w.kernel.now
        for b in self.bursts.get(proc, ()):
            if b.covers(path, now, what):
                b.tries -= 1
                b.fresh = False
                raise _error(b.err, path, op)


def _error(err: str, path: str, op: str) -> Exception:
    if op == "posix":
        code = errno.EIO if err == "EIO" else errno.ESTALE
        return OSError(code, f"{os.strerror(code)} (simulated read fault)", path)
    verb = {"s3.get": "GET", "s3.head": "HEAD"}.get(op, "LIST")
    why = "InternalError (HTTP 500)" if err == "5xx" else "ReadTimeoutError: Read timeout on endpoint URL"
    return StoreReadFailed(f"{verb} s3://sim/{path} failed: {why} (simulated)")  # as pipeline.storage.s3 raises it


class ReadOs:
    """``os`` for a module that reads records: its ``open`` for reading is a read of a record, ``fstat`` and
    ``fdopen`` of such a descriptor give a torn or short read when one is due; its metadata reads meet bursts.
    ``points``: False for the lease's records (the lease store's own calls are its points)."""

    def __init__(self, faults: ReadFaults, inner: Any, points: bool = True) -> None:
        self._f = faults
        self._inner = inner
        self._points = points
        self._cut: dict[int, tuple[Tear, int | None]] = {}

    def open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        tear = None
        if flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_DIRECTORY:
            if self._points:
                tear = self._f.read("record", os.fspath(path))
            else:
                self._f.meta(path)
        fd: int = self._inner.open(path, flags, *args, **kwargs)
        self._cut.pop(fd, None)
        if tear is not None:
            self._cut[fd] = (tear, None)
        return fd

    def fstat(self, fd: int) -> os.stat_result:
        st: os.stat_result = self._inner.fstat(fd)
        cut = self._cut.get(fd)
        if cut is None:
            return st
        keep = st.st_size // 2
        self._cut[fd] = (cut[0], keep)
        if cut[0].short:
            return st
        fields = list(st)
        fields[6] = keep  # st_size: the attributes cut too (a torn record)
        return os.stat_result(fields)

    def fdopen(self, fd: int, *args: Any, **kwargs: Any) -> Any:
        f = self._inner.fdopen(fd, *args, **kwargs)
        cut = self._cut.pop(fd, None)
        if cut is None:
            return f
        keep = cut[1] if cut[1] is not None else self._inner.fstat(fd).st_size // 2
        return _Cut(f, keep)

    def lstat(self, path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        self._f.meta(path)
        return self._inner.lstat(path, *args, **kwargs)  # type: ignore[no-any-return]

    def listdir(self, path: Any = ".") -> list[str]:
        self._f.meta(path)
        return self._inner.listdir(path)  # type: ignore[no-any-return]

    def scandir(self, path: Any = ".") -> Any:
        self._f.meta(path)
        return self._inner.scandir(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Cut:
    """A file whose read gives at most ``keep`` bytes."""

    def __init__(self, f: Any, keep: int) -> None:
        self._f = f
        self._left = keep

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._f.read(n)
        data = data[: self._left]
        self._left -= len(data)
        return data

    def __enter__(self) -> _Cut:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _data_open(faults: ReadFaults) -> Any:
    """``open`` as :mod:`pipeline.storage.integrity` sees it (``hash_file``): a read of data."""

    def sim_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode and "+" not in mode and not isinstance(file, int):
            faults.read("data", os.fspath(file))
        return builtins.open(file, mode, *args, **kwargs)

    return sim_open


_MISSING = object()


@contextlib.contextmanager
def installed(faults: ReadFaults) -> Iterator[None]:
    """The real code's reads through ``faults`` for the block (see the module docstring)."""
    from pipeline.checkpoint.protocol import lease_records  # noqa: PLC0415
    from pipeline.checkpoint.stores import repair  # noqa: PLC0415
    from pipeline.storage import backend, integrity, reads  # noqa: PLC0415

    saved: list[tuple[Any, str, Any]] = []

    def put(mod: Any, name: str, value: Any) -> None:
        saved.append((mod, name, mod.__dict__.get(name, _MISSING)))
        setattr(mod, name, value)

    put(integrity, "os", ReadOs(faults, integrity.os))
    put(integrity, "open", _data_open(faults))
    put(repair, "os", ReadOs(faults, repair.os))
    put(reads, "os", ReadOs(faults, reads.os, points=False))
    put(backend, "os", ReadOs(faults, backend.os, points=False))
    put(lease_records, "os", ReadOs(faults, lease_records.os, points=False))
    try:
        yield
    finally:
        for mod, name, value in reversed(saved):
            if value is _MISSING:
                delattr(mod, name)
            else:
                setattr(mod, name, value)
