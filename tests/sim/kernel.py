"""The simulation's kernel: real code on real threads, stepped one at a time by one seeded scheduler.

Each simulated *process* (a committer, a writer) is one or more *actors*: a greenlet running the real code (a
coroutine of the one thread, switched only where the kernel says). Exactly one runs at a time, the scheduler or
one actor. An actor runs until it reaches a *point* (a
store operation, an I/O op of :mod:`pipeline.storage.faults`, a lease read or write, a sleep, a lock), where it
hands control back; the scheduler checks the invariants, asks its :class:`Chooser` which actor goes next and
whether a fault is injected where that actor stands, and resumes it. Time is virtual (:class:`SimTime`): it moves
only when every actor sleeps, so a schedule replays exactly from its choices.

The real code is patched only where it reaches the world: ``time`` (each process has its own wall clock, skewed
by the schedule, and one monotonic clock), ``threading`` in the lease module (its heartbeat thread becomes an
actor), ``os.getpid``/``os.kill``/``socket.gethostname`` for the lease's liveness check, ``secrets`` (tokens from
the schedule's seed) and the I/O-op hook.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time as _time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import greenlet

from pipeline.storage import faults

BASE_TIME = 1_800_000_000.0
"""Wall-clock time of the simulation's start (every process's clock is this plus virtual time plus its skew)."""


class Killed(BaseException):
    """The actor's process died here (a simulated ``kill -9``): no ``except Exception`` catches it."""


class Stuck(Exception):
    """No actor can ever run again (a deadlock of the simulated processes)."""


@dataclass
class Fault:
    kind: str  # pause | eio | kill | torn | stale | damage | readfail | short (tests.sim.read_faults)
    arg: Any = None

    def __str__(self) -> str:
        return f"{self.kind}({self.arg})" if self.arg is not None else self.kind


@dataclass
class Proc:
    """A simulated process: its actors die together; its wall clock is skewed; its pid and host are its own."""

    name: str
    pid: int
    host: str
    skew: float = 0.0
    node: str = ""
    dead: bool = False
    actors: list[Actor] = field(default_factory=list)


@dataclass
class Actor:
    name: str
    proc: Proc
    target: Callable[[], Any]
    glet: Any = None
    state: str = "new"  # new | ready | blocked | done
    wake_at: float | None = None  # blocked: runnable again at this virtual time (None: only when ready() says)
    ready: Callable[[], bool] | None = None  # blocked: runnable once this holds
    at: str = "start"  # the point it stands at
    fault: Fault | None = None  # delivered when it resumes
    result: Any = None
    error: BaseException | None = None


class Chooser:
    """Decides every choice of a schedule: which actor runs next, and which fault (if any) is injected."""

    def __init__(self, seed: int, script: list[int] | None = None) -> None:
        self.rng = random.Random(seed)
        self.script = script
        self.taken: list[tuple[int, int]] = []  # (choice, number of options) in order

    def choose(self, n: int) -> int:
        if n <= 1:
            return 0
        i = len(self.taken)
        if self.script is not None:
            c = self.script[i] if i < len(self.script) else 0
            c = min(c, n - 1)
        else:
            c = self.rng.randrange(n)
        self.taken.append((c, n))
        return c

    def chance(self, p: float) -> bool:
        """A yes/no choice that is yes with probability ``p`` when drawn at random (0 = no in a script)."""
        if self.script is not None:
            return self.choose(2) == 1
        hit = self.rng.random() < p
        self.taken.append((int(hit), 2))
        return hit


class Kernel:
    """One schedule's processes, actors, virtual clock and scheduler."""

    def __init__(self, pick: Callable[[Kernel, list[Actor]], Actor | None], on_point: Callable[[Kernel, Actor], bool]):
        self.now = 0.0
        self.procs: dict[str, Proc] = {}
        self.actors: list[Actor] = []
        self._main = greenlet.getcurrent()  # the scheduler: every actor's parent
        self._by_glet: dict[Any, Actor] = {}
        self.pick = pick
        self.on_point = on_point
        self.steps = 0
        self.trace: list[str] = []
        self.free = False
        self.looking = 0  # the simulation's own looks in progress inside an actor: no point, no fault there
        self._beside: dict[Any, Actor] = {}  # a greenlet running aside (a pool's work): the actor it works for

    # -- building -------------------------------------------------------------------------------------------

    def proc(self, name: str, host: str, skew: float = 0.0, node: str = "") -> Proc:
        p = Proc(name, pid=10_000 + len(self.procs), host=host, skew=skew, node=node or name)
        self.procs[name] = p
        return p

    def spawn(self, proc: Proc, name: str, target: Callable[[], Any]) -> Actor:
        a = Actor(f"{proc.name}.{name}" if name else proc.name, proc, target)
        proc.actors.append(a)
        self.actors.append(a)
        a.glet = greenlet.greenlet(lambda: self._run(a), parent=self._main)
        self._by_glet[a.glet] = a
        a.state = "ready"
        a.at = "start"
        return a

    def _run(self, a: Actor) -> None:
        try:
            if a.proc.dead:
                raise Killed("dead before start")
            a.result = a.target()
        except Killed:
            pass
        except BaseException as e:  # noqa: BLE001 - recorded, judged by the world
            a.error = e
        finally:
            a.state = "done"

    def current(self) -> Actor | None:
        return self._by_glet.get(greenlet.getcurrent())

    def owner(self) -> Actor | None:
        """The actor whose process does what runs now: :meth:`current`, or the one a pool's work runs aside for
        (:meth:`aside`: no point there, but its process's reads still meet the faults of its mount); None for the
        simulation's own looks (:meth:`outside`) and the scheduler."""
        if self.looking:
            return None
        glet = greenlet.getcurrent()
        return self._by_glet.get(glet) or self._beside.get(glet)

    # -- what an actor calls ----------------------------------------------------------------------------------

    def point(self, at: str) -> Fault | None:
        """Hand control to the scheduler at ``at``; returns the fault injected here (the caller applies it)."""
        a = self.current()
        if a is None or self.looking:
            return None
        a.at = at
        if self.free:  # one process left, no faults: it runs on without a choice to make here
            if a.proc.dead:
                raise Killed(f"{a.proc.name} was killed")
            return None
        a.state = "ready"
        self._switch(a)
        f, a.fault = a.fault, None
        return f

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Run what follows as another thread of the actor's process would: the kernel sees no actor there
        (:meth:`current` is None), so its points are no choices, its sleeps are real and brief."""
        glet = greenlet.getcurrent()
        a = self._by_glet.pop(glet, None)
        if a is not None:
            self._beside[glet] = a
        try:
            yield
        finally:
            if a is not None:
                self._beside.pop(glet, None)
                self._by_glet[glet] = a

    @contextmanager
    def outside(self) -> Iterator[None]:
        """The simulation's own look from inside an actor's greenlet (a judgement of this instant, not an act of the
        actor): its store calls are no scheduling points, so nothing else runs and no fault lands meanwhile."""
        self.looking += 1
        try:
            yield
        finally:
            self.looking -= 1

    def block(self, at: str, ready: Callable[[], bool] | None = None, until: float | None = None) -> None:
        """Not runnable until ``ready()`` holds or virtual time reaches ``until``."""
        a = self.current()
        if a is None:
            raise RuntimeError("block() outside an actor")
        a.at, a.ready, a.wake_at, a.state = at, ready, until, "blocked"
        self._switch(a)
        a.fault = None

    def sleep(self, s: float) -> None:
        if self.current() is None:
            _time.sleep(min(s, 0.001))
            return
        self.block(f"sleep {s:g}", until=self.now + max(s, 1e-6))

    def _switch(self, a: Actor) -> None:
        self._main.switch()
        if a.proc.dead:
            raise Killed(f"{a.proc.name} was killed")

    # -- the scheduler ----------------------------------------------------------------------------------------

    def runnable(self) -> list[Actor]:
        out = []
        for a in self.actors:
            woken = a.state == "blocked" and (
                a.proc.dead or (a.ready is not None and a.ready()) or (a.wake_at is not None and a.wake_at <= self.now)
            )
            if a.state == "ready" or woken:
                out.append(a)
        return out

    def run(self, max_steps: int = 20_000) -> None:
        while True:
            live = [a for a in self.actors if a.state != "done"]
            if not live:
                return
            ready = self.runnable()
            if not ready:
                wakes = [a.wake_at for a in live if a.state == "blocked" and a.wake_at is not None]
                if not wakes:
                    raise Stuck(
                        "every actor waits and none has a deadline: " + ", ".join(f"{a.name}@{a.at}" for a in live)
                    )
                self.now = max(self.now, min(wakes))
                continue
            a = self.pick(self, ready)
            if a is None:  # the picker moved time or changed its plan: look again
                continue
            self.steps += 1
            if self.steps > max_steps:
                raise Stuck(f"more than {max_steps} steps")
            if a.state == "blocked":
                a.ready, a.wake_at = None, None
            a.state = "running"
            if not self.on_point(self, a):  # paused (or otherwise held back) instead of run
                continue
            a.glet.switch()

    def kill(self, proc: Proc) -> None:
        proc.dead = True
        self.trace.append(f"t={self.now:.2f} kill {proc.name}")

    def shutdown(self) -> None:
        """Kill every process left (a schedule cut short) and let the threads end."""
        for p in self.procs.values():
            p.dead = True
        for a in list(self.actors):
            if a.state != "done":
                a.glet.switch()


# -- what the real code sees in place of the world ----------------------------------------------------------


class SimTime:
    """``time`` for the patched modules: virtual, per process (its skew); everything else passes through."""

    def __init__(self, kernel: Kernel) -> None:
        self._k = kernel

    def time(self) -> float:
        a = self._k.current()
        return BASE_TIME + self._k.now + (a.proc.skew if a is not None else 0.0)

    def monotonic(self) -> float:
        return 1000.0 + self._k.now

    def sleep(self, s: float) -> None:
        self._k.sleep(s)

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


class SimEvent:
    def __init__(self, kernel: Kernel) -> None:
        self._k = kernel
        self._flag = False

    def set(self) -> None:
        self._flag = True

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        until = self._k.now + timeout if timeout is not None else None
        self._k.block("event.wait", ready=lambda: self._flag, until=until)
        return self._flag


class SimLock:
    def __init__(self, kernel: Kernel) -> None:
        self._k = kernel
        self._held = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._k.current() is None:
            self._held = True
            return True
        while self._held:
            self._k.block("lock", ready=lambda: not self._held)
        self._held = True
        return True

    def release(self) -> None:
        self._held = False

    def __enter__(self) -> SimLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SimThread:
    """``threading.Thread`` for the lease's heartbeat: an actor of the process that starts it."""

    def __init__(self, kernel: Kernel, target: Callable[[], Any], name: str = "", daemon: bool = True) -> None:
        self._k = kernel
        self._target = target
        self._name = name
        self._actor: Actor | None = None

    def start(self) -> None:
        a = self._k.current()
        if a is None:
            raise RuntimeError("a simulated thread is started by an actor")
        self._actor = self._k.spawn(a.proc, self._name or "thread", self._target)

    def is_alive(self) -> bool:
        return self._actor is not None and self._actor.state != "done"

    def join(self, timeout: float | None = None) -> None:
        act = self._actor
        if act is None or act.state == "done":
            return
        until = self._k.now + timeout if timeout is not None else None
        self._k.block("join", ready=lambda: act.state == "done", until=until)


class SimThreading:
    def __init__(self, kernel: Kernel) -> None:
        self._k = kernel

    def Event(self) -> SimEvent:  # noqa: N802 - threading's names
        return SimEvent(self._k)

    def Lock(self) -> SimLock:  # noqa: N802
        return SimLock(self._k)

    def Thread(self, target: Callable[[], Any], name: str = "", daemon: bool = True) -> SimThread:  # noqa: N802
        return SimThread(self._k, target, name, daemon)

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


class SimOs:
    """``os`` for the lease module: each process's own pid; ``kill(pid, 0)`` answers from the processes' fate."""

    def __init__(self, kernel: Kernel) -> None:
        self._k = kernel

    def getpid(self) -> int:
        a = self._k.current()
        return a.proc.pid if a is not None else os.getpid()

    def kill(self, pid: int, sig: int) -> None:
        a = self._k.current()
        for p in self._k.procs.values():
            if p.pid == pid and (a is None or p.node == a.proc.node):  # a pid means a process of this node only
                if p.dead:
                    raise ProcessLookupError(pid)
                return
        raise ProcessLookupError(pid)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class SimSocket:
    def __init__(self, kernel: Kernel) -> None:
        self._k = kernel

    def gethostname(self) -> str:
        a = self._k.current()
        return a.proc.host if a is not None else "observer"


class SimSecrets:
    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed ^ 0x5EC12E7)

    def token_hex(self, n: int = 16) -> str:
        return "".join(f"{self._rng.randrange(256):02x}" for _ in range(n))


def _machine(kernel: Kernel) -> str:
    """A simulated process's machine: its node (two nodes may share a hostname, never a machine)."""
    a = kernel.current()
    return f"machine-{a.proc.node}" if a is not None else "machine-observer"


def _start(kernel: Kernel, pid: int) -> int | None:
    """The start of simulated process ``pid`` as its own node sees it (None: not running there)."""
    a = kernel.current()
    for p in kernel.procs.values():
        if p.pid == pid and not p.dead and (a is None or p.node == a.proc.node):
            return 1
    return None


class _IoHook:
    """Installed as the I/O-op plan of :mod:`pipeline.storage.faults`: every filesystem mutation is a point."""

    def __init__(self, kernel: Kernel, apply: Callable[[Fault | None, str], None]) -> None:
        self._k = kernel
        self._apply = apply

    def on_op(self, kind: str, path: str) -> None:
        at = f"io {kind} {path}"
        self._apply(self._k.point(at), at)


def raise_eio(where: str) -> None:
    raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (simulated at {where})")


@contextmanager
def patched(
    kernel: Kernel, seed: int, modules: list[Any], lease_module: Any, apply_io: Callable[[Fault | None, str], None]
) -> Iterator[None]:
    """Point the real code at the kernel for the block (see the module docstring)."""
    saved: list[tuple[Any, str, Any]] = []

    def put(mod: Any, name: str, value: Any) -> None:
        saved.append((mod, name, getattr(mod, name, None)))  # (an older protocol may lack it: set, then unset)
        setattr(mod, name, value)

    sim_time = SimTime(kernel)
    for mod in modules:
        put(mod, "time", sim_time)
    put(lease_module, "threading", SimThreading(kernel))
    put(lease_module, "socket", SimSocket(kernel))
    put(lease_module, "secrets", SimSecrets(seed))
    records = getattr(lease_module, "lease_records", None)  # where Holder lives (the lease of 79e094b: itself)
    for mod in {id(m): m for m in (lease_module, records or lease_module)}.values():
        put(mod, "os", SimOs(kernel))
        put(mod, "machine_id", lambda: _machine(kernel))
        put(mod, "process_start", lambda pid: _start(kernel, pid))
    previous, faults._Active.plan = faults._Active.plan, _IoHook(kernel, apply_io)  # type: ignore[assignment]
    try:
        yield
    finally:
        faults._Active.plan = previous
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)
