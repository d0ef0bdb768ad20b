"""A simulated world stepped by a plan instead of a seed: run these processes until a condition holds, freeze
the others (a ghost frozen at a chosen line of its code, with the others running), act on the world between
phases. The invariants of :mod:`tests.sim.world` are checked after every operation, as in a random schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.sim.kernel import Actor, Chooser, Kernel
from tests.sim.world import Settings, World


@dataclass
class Phase:
    procs: frozenset[str]
    """The processes that run in this phase (every other one is frozen; the writer runs when named)."""
    until: Callable[[World], bool] | None = None
    """The phase ends once this holds (checked before each operation); None: once its processes are done."""
    action: Callable[[World], None] | None = None
    """Done to the world when the phase starts (damage, a step staged again, a fault armed)."""


def run(
    *procs: str, until: Callable[[World], bool] | None = None, then: Callable[[World], None] | None = None
) -> Phase:
    return Phase(frozenset(procs), until, then)


def at(proc: str, *parts: str) -> Callable[[World], bool]:
    """``proc``'s main actor stands at an operation whose description holds every one of ``parts``."""

    def cond(w: World) -> bool:
        a = w.kernel.procs[proc].actors[0] if proc in w.kernel.procs else None
        return a is not None and a.state != "done" and all(p in a.at for p in parts)

    return cond


def any_at(proc: str, *parts: str) -> Callable[[World], bool]:
    """Any actor of ``proc`` (its heartbeat thread too) stands at such an operation."""

    def cond(w: World) -> bool:
        p = w.kernel.procs.get(proc)
        return p is not None and any(a.state != "done" and all(x in a.at for x in parts) for a in p.actors)

    return cond


def ended(proc: str) -> Callable[[World], bool]:
    return lambda w: proc in w.ended


def after(cond: Callable[[World], bool], then: Callable[[World], bool]) -> Callable[[World], bool]:
    """``then`` once ``cond`` has held (e.g. the second time a process reaches a point)."""
    seen = [False]

    def both(w: World) -> bool:
        seen[0] = seen[0] or cond(w)
        return seen[0] and then(w)

    return both


class Directed(World):
    """A world whose scheduler follows ``phases``; after the last one, every process runs to its end."""

    def __init__(self, settings: Settings, tmp: Path, phases: Iterable[Phase]) -> None:
        super().__init__(0, settings, Chooser(0, script=[]), tmp)
        self.phases = list(phases)
        self.faults_off = True  # faults are the plan's own (its actions)
        self.arm: dict[str, str] = {}  # proc -> a fault kind every lease read of it meets (see _PointLease)

    def _pick(self, k: Kernel, ready: list[Actor]) -> Actor | None:
        while self.phases:
            ph = self.phases[0]
            if ph.action is not None:
                action, ph.action = ph.action, None
                action(self)
                self._checked = None
                self._dirty = True
                return None
            if ph.until is not None and ph.until(self):
                self.phases.pop(0)
                continue
            allowed = [a for a in ready if a.proc.name in ph.procs]
            if allowed:
                return allowed[0]
            timed = [a.wake_at for a in k.actors if a.proc.name in ph.procs and a.state == "blocked"
                     and a.wake_at is not None and not a.proc.dead]  # fmt: skip
            if timed:
                k.now = max(k.now, min(timed))
                return None
            self.phases.pop(0)  # its processes are done (or wait on each other): the plan goes on
        return ready[0]

    def lease_fault(self, proc: str) -> str | None:
        return self.arm.get(proc)


def plan(settings: Settings, tmp: Path, *phases: Phase, prepare: Callable[[World], None] | None = None) -> Directed:
    """Run ``phases`` in a fresh world (``prepare``: done first, outside the simulation: steps committed by a
    committer that came and went); returns the world, its violations in it."""
    w = Directed(settings, tmp, phases)
    if prepare is not None:
        w.before = lambda: prepare(w)  # type: ignore[method-assign]
    w.run()
    return w


def committed_before(*steps: int) -> Callable[[World], None]:
    """``prepare``: ``steps`` staged and committed by a committer that then released the lease."""
    from pipeline.checkpoint.protocol.committer import Committer  # noqa: PLC0415

    def prepare(w: World) -> None:
        w.stage_now(*steps)
        c = Committer(w.layout, w.policy, w.raw_store())
        with c.hold(takeover=True):
            c.recover()
            c.commit_ready()

    return prepare
