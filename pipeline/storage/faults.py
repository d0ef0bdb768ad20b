"""Fault injection for tests: named points, and SQLite-style crash testing by counting I/O operations.

**Named points.** ``PIPELINE_FAULTS="point[@key=value...][;point...]"`` makes :func:`inject` raise.
Points are named where I/O happens (``shard_save.before_marker``, ``verify.before_publish``, ...); optional
``key=value`` filters match the call's context, e.g. ``shard_save.before_marker@rank=1@step=4``.
The special filter ``action=exit`` kills the process with ``os._exit(17)`` instead of raising, like a crash;
``action=eio`` raises ``OSError(EIO)`` as a storage that does not answer does;
``action=sleep@seconds=S`` only delays the caller (a slow rank, a slow disk). Every point also matches
``restart=N``, SLURM's restart count of the job (``restart=0``: only its first run, not the one SLURM requeued).

**Counted I/O operations.** Every filesystem mutation of the pipeline first calls :func:`io_op`: each file
creation, write, fsync of a file or a directory, rename, link, unlink, rmtree and mkdir done by
:mod:`pipeline.storage.atomic`, and the file creations, data writes and fsyncs of the streaming safetensors
and DCP writers. Without a plan that is one global check. With a plan, operations are numbered from 1 and:

* ``crash_at=N`` — op N does not happen: the "process dies" there. In-process (tests) :class:`SimulatedCrash`
  (a ``BaseException``, so no ``except Exception`` swallows it) is raised at op N *and at every op after it*:
  a dead process does no more I/O, so cleanup handlers that would unlink a temp file cannot either, and the
  disk is left as a real crash leaves it. With ``PIPELINE_CRASH_AT_OP=N`` (subprocesses) op N calls
  ``os._exit(17)``.
* an injected error — op N (``op=N``), or the ``nth`` op of a ``kind`` (optionally only among paths
  containing ``path``), raises ``OSError(errno)`` instead of happening, once:
  ``PIPELINE_IO_ERROR="op=7,errno=ENOSPC"`` or ``"kind=fsync,errno=EIO,nth=2"`` or
  ``"kind=rename,path=checkpoints/latest,errno=EIO"``.
* every op is recorded as ``(kind, path)`` in the plan's ``trace`` (:func:`tracing` for tests).

The environment variables are read once, when this module is imported (a task process inherits them).
"""

from __future__ import annotations

import errno as errno_codes
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

CRASH_EXIT_CODE = 17
"""Exit status of a process killed by ``action=exit`` or ``PIPELINE_CRASH_AT_OP``."""

IO_KINDS = frozenset({"create", "write", "fsync", "fsync_dir", "rename", "link", "unlink", "rmtree", "mkdir"})
"""What :func:`io_op` counts. ``create`` is a new (empty) file; ``rename`` and ``link`` name their destination."""

CRASH_ENV = "PIPELINE_CRASH_AT_OP"
IO_ERROR_ENV = "PIPELINE_IO_ERROR"


class InjectedFault(RuntimeError):
    pass


def inject(point: str, **context: object) -> None:
    spec = os.environ.get("PIPELINE_FAULTS", "")
    if not spec:
        return
    for item in spec.split(";"):
        name, *filters = item.strip().split("@")
        if name != point:
            continue
        wanted = dict(f.split("=", 1) for f in filters if "=" in f)
        context.setdefault("restart", os.environ.get("SLURM_RESTART_COUNT", "0"))  # @restart=0: a job's first run
        action = wanted.pop("action", "raise")
        seconds = float(wanted.pop("seconds", "0"))
        if all(str(context.get(k)) == v for k, v in wanted.items()):
            if action == "sleep":
                time.sleep(seconds)
                continue
            if action == "exit":
                os._exit(CRASH_EXIT_CODE)
            if action == "eio":  # the storage failing (a FUSE filer away), as the OS reports it
                raise OSError(
                    errno_codes.EIO, f"Input/output error (injected at {point})", str(context.get("path", ""))
                )
            raise InjectedFault(f"injected fault at {point} {context}")


class SimulatedCrash(BaseException):
    """The process "died" at a counted I/O operation (in-process crash testing); never caught by the pipeline."""


@dataclass
class IoPlan:
    """What to do at which counted I/O operation, and the trace of the operations seen so far."""

    crash_at: int | None = None
    """Op number (from 1) at which the process dies; every later op dies too."""
    exit_on_crash: bool = False
    """``os._exit(17)`` at the crash instead of raising :class:`SimulatedCrash` (for subprocesses)."""
    fail_at: int | None = None
    """Op number that raises ``OSError(errno)`` instead of happening."""
    fail_kind: str | None = None
    """Or: the ``fail_nth`` op of this kind (among paths containing ``fail_path``, when given) raises."""
    fail_nth: int = 1
    fail_path: str | None = None
    errno: int = errno_codes.EIO
    trace: list[tuple[str, str]] = field(default_factory=list)
    """Every op reached, in order: ``(kind, path)``; the crash op is the last entry."""
    crashed: bool = False
    failed: bool = False
    _kind_seen: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.fail_kind is not None and self.fail_kind not in IO_KINDS:
            raise ValueError(f"unknown I/O op kind {self.fail_kind!r}; kinds: {', '.join(sorted(IO_KINDS))}")

    @property
    def count(self) -> int:
        return len(self.trace)

    def on_op(self, kind: str, path: str) -> None:
        with self._lock:
            if self.crashed:
                raise SimulatedCrash(f"simulated crash: no I/O after the crash ({kind} {path})")
            self.trace.append((kind, path))
            n = len(self.trace)
            if self.crash_at is not None and n >= self.crash_at:
                self.crashed = True
                if self.exit_on_crash:
                    os._exit(CRASH_EXIT_CODE)
                raise SimulatedCrash(f"simulated crash at I/O op {n} ({kind} {path})")
            if self.failed:
                return
            if self.fail_kind == kind and (self.fail_path is None or self.fail_path in path):
                self._kind_seen += 1
                hit = self._kind_seen == self.fail_nth
            else:
                hit = self.fail_at == n
            if hit:
                self.failed = True
                raise OSError(self.errno, f"{os.strerror(self.errno)} (injected at I/O op {n}, {kind})", path)


class _Active:
    """The plan in force for this process (None: :func:`io_op` does nothing)."""

    plan: IoPlan | None = None


def io_op(kind: str, path: str | os.PathLike[str]) -> None:
    """Count one filesystem mutation that is about to happen (see the module docstring)."""
    plan = _Active.plan
    if plan is None:
        return
    plan.on_op(kind, os.fspath(path))


@contextmanager
def io_plan(
    *,
    crash_at: int | None = None,
    fail_at: int | None = None,
    fail_kind: str | None = None,
    fail_nth: int = 1,
    fail_path: str | None = None,
    errno: int = errno_codes.EIO,
) -> Iterator[IoPlan]:
    """Install a plan for the ``with`` block (this process, all threads); the previous plan comes back after."""
    plan = IoPlan(
        crash_at=crash_at, fail_at=fail_at, fail_kind=fail_kind, fail_nth=fail_nth, fail_path=fail_path, errno=errno
    )
    previous, _Active.plan = _Active.plan, plan
    try:
        yield plan
    finally:
        _Active.plan = previous


@contextmanager
def tracing() -> Iterator[list[tuple[str, str]]]:
    """Record the ``(kind, path)`` of every counted I/O operation in the block; inject nothing."""
    with io_plan() as plan:
        yield plan.trace


def _errno_code(name: str) -> int:
    code = getattr(errno_codes, name.upper(), None) if not name.isdigit() else int(name)
    if not isinstance(code, int):
        raise ValueError(f"unknown errno {name!r} (use a name such as EIO or ENOSPC)")
    return code


def plan_from_env(env: Mapping[str, str]) -> IoPlan | None:
    """The plan that ``PIPELINE_CRASH_AT_OP`` / ``PIPELINE_IO_ERROR`` describe, or None when neither is set."""
    crash, failure = env.get(CRASH_ENV, "").strip(), env.get(IO_ERROR_ENV, "").strip()
    if not crash and not failure:
        return None
    plan = IoPlan(exit_on_crash=True)
    if crash:
        if not crash.isdigit() or int(crash) < 1:
            raise ValueError(f"{CRASH_ENV}={crash!r}: give the number (from 1) of the I/O op to crash at")
        plan.crash_at = int(crash)
    if failure:
        try:
            spec = dict(item.strip().split("=", 1) for item in failure.split(",") if item.strip())
            plan.errno = _errno_code(spec.pop("errno", "EIO"))
            plan.fail_at = int(spec.pop("op")) if "op" in spec else None
            plan.fail_kind = spec.pop("kind", None)
            plan.fail_nth = int(spec.pop("nth", "1"))
            plan.fail_path = spec.pop("path", None)
            plan.__post_init__()
        except ValueError as e:
            raise ValueError(f"{IO_ERROR_ENV}={failure!r}: {e}") from None
        if spec or (plan.fail_at is None) == (plan.fail_kind is None):
            raise ValueError(
                f"{IO_ERROR_ENV}={failure!r}: give op=N or kind=K[,nth=N][,path=S], plus errno=NAME (and nothing else)"
            )
    return plan


_Active.plan = plan_from_env(os.environ)
