"""One simulated world: a checkpoints root (a real directory, or a bucket in memory), a writer (one or two ranks; a
training job that may restart and save again), a ghost, a live committer and a newcomer, the faults a schedule
injects, and the invariants checked after every operation.

The committers are the real :class:`~pipeline.checkpoint.protocol.committer.Committer` over the real stores; only the
world around them is simulated (:mod:`tests.sim.kernel`); reads fail as a shared filesystem's and a bucket's do
(:mod:`tests.sim.read_faults`), and damage hits data and records (:mod:`tests.sim.damage`). The invariants are what
a user relies on, judged per copy of a step (its number and the attempt that saved it: a copy damaged exempts no
other copy of the same step):

* **reader**: what a reader resumes from (``read_newest`` of a directory, ``newest_manifest`` of a bucket)
  names a step whose every file verifies; it fails only where the copy committed there was damaged, or ``latest``
  itself is (by the schedule);
* **no regress**: it never goes back, except past copies that were damaged or retired: a read that fails (unknown)
  never moves it back;
* **kept**: a copy that verified is never removed (nor changed) unless retention, judged at the removal,
  lets it go; the newest step that verifies always stays;
* **quarantine**: once the schedule is over, no copy staged whole whose files match its markers is in quarantine
  unless the schedule damaged it: a read that fails quarantines nothing;
* **lease**: the lease's highest epoch never goes back (no ghost overwrites a newer holder's record);
* **one holder**: a newcomer that was not appointed is refused while a holder renews its lease;
* **resume**: what a resuming trainer decides from (the newest committed step, or else the staged steps it waits
  for, :func:`~pipeline.checkpoint.stores.stores.uncommitted`) is never older than the newest copy staged whole
  and not damaged: a step saved before a kill is never trained again, whatever the committer is doing then; the
  restarted trainer's own decision (:func:`~pipeline.checkpoint.resume.decide`, through reads that fail) is either
  that new or one line saying why it cannot resume, never an exception;
* **rerun**: after the schedule, a committer started afresh finishes and ``latest`` names the newest step a copy of
  which was staged, not damaged and not retired.

(A lease record damaged suspends the lease's invariants until its holder writes it again.)
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.checkpoint import resume
from pipeline.checkpoint.manifest import Marker, marker_path, read_newest, write_marker
from pipeline.checkpoint.protocol import committer, ownership, retention, trash
from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer, CommitterBusy, CommitterLost
from pipeline.checkpoint.stores import bucket_store, bucket_trash, posix_store, remote, stores
from pipeline.checkpoint.stores.bucket_store import BucketCheckpoints
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.checkpoint.stores.remote import Remote
from pipeline.errors import PipelineError, VerificationError
from pipeline.storage import reads, settle, waiting
from pipeline.storage.atomic import clear_file, write_bytes_atomic
from pipeline.storage.backend import PosixStorage
from pipeline.storage.integrity import describe
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.s3 import S3Url
from pipeline.storage.s3_probe import StoreError
from tests.seed_helpers import TEST_FORMAT
from tests.sim import damage as harm
from tests.sim.kernel import Actor, Chooser, Fault, Kernel, Killed, Proc, Stuck, patched, raise_eio
from tests.sim.memory_s3 import MemoryBucket
from tests.sim.read_faults import BURST_S, READ_POINTS, RECORD_AT, S3_READS, TEAR_S, ReadFaults, burst_errors, installed

PATCHED = [ownership, committer, posix_store, bucket_store, retention, waiting, settle, reads, trash, bucket_trash]
FAULT_POINTS = ("io ", "s3.", "lease.", "store.", "read ")
"""Where a fault may be injected: every operation on the store, every read (not a sleep or a lock of the process
itself)."""
MUTATIONS = ("io ", "s3.put", "s3.delete", "s3.copy", "lease.put", "lease.delete")
LEASE_S = 30.0
RESUME_S = 60.0
"""The restarted trainer's deadline for the staged steps it waits for (``resume.decide``)."""
KIND_WEIGHTS = {"readfail": 3}
"""How often a kind of fault is drawn where it applies, relative to the others (reads fail as often as the rest)."""


def visible(at: str) -> bool:
    """Whether the operation at ``at`` can change what the invariants look at: a rename, an unlink, a link, a
    new directory or a file written in place in ``checkpoints/`` (not a temp file, not staging, not an fsync), any
    object written or deleted, a lease record written or deleted."""
    if at.startswith(("s3.put", "s3.delete", "s3.copy", "lease.put", "lease.delete")):
        return True
    if not at.startswith("io ") or "/staging/" in at:
        return False
    kind = at.split(" ", 2)[1]
    placed = kind in ("create", "write") and ".tmp-" not in at  # a file written where it stays
    return kind in ("rename", "unlink", "rmtree", "link", "mkdir") or placed


def payload(step: int, rank: int, name: str, attempt: str) -> bytes:
    """A staged file's bytes: its attempt's own, so that bytes of one attempt never pass for another's."""
    return f"step={step} rank={rank} file={name} attempt={attempt}\n".encode() * 256


class Violation(AssertionError):
    """An invariant a user relies on was broken."""


@dataclass
class Settings:
    """One schedule's world: drawn from the seed (:meth:`draw`), or set by a test."""

    store: str = "posix"
    steps: tuple[int, ...] = (2, 4, 6)
    keep_last: int = 1
    ghost: bool = True
    ghost_passes: int | None = None  # None: the ghost follows the writer; N: N passes, then it releases
    live_at: float | None = 5.0  # when the live (appointed) committer starts; None: no live committer
    newcomer_at: float | None = None  # when a newcomer (not appointed) tries; None: none
    write_every: float = 4.0
    skews: dict[str, float] = field(default_factory=dict)
    hosts: dict[str, str] = field(default_factory=dict)
    fault_rate: float = 0.0
    max_faults: int = 3
    kinds: tuple[str, ...] = ("pause", "eio", "kill", "torn", "stale", "damage", "readfail", "short")
    world: int = 1  # the writer's ranks (each stages its own files and marker)
    restart_at: float | None = None  # after its steps, the training job restarts once its last step is committed
    # or this many seconds later (a new appointed committer starts), and saves again, under a new attempt, every
    # step above what it resumes from; None: it does not restart

    @staticmethod
    def draw(seed: int, store: str) -> Settings:
        import random  # noqa: PLC0415

        r = random.Random(seed)
        s = Settings(store=store)
        s.steps = (2, 4, 6) if r.random() < 0.7 else (2, 4, 6, 8)
        s.keep_last = r.choice((1, 1, 2))
        s.live_at = r.choice((0.5, 3.0, 6.0, 12.0))
        s.newcomer_at = r.choice((None, None, 2.0, 8.0, 20.0, 45.0))
        s.write_every = r.choice((1.0, 3.0, 6.0))
        for name in ("ghost", "live", "newcomer"):
            s.skews[name] = r.choice((0.0, 0.0, 0.0, 45.0, -45.0, 120.0, -120.0))
        same = r.random() < 0.2
        s.hosts = {"ghost": "node1", "live": "node1" if same else "node2", "newcomer": "node3" if not same else "node1"}
        s.fault_rate = r.choice((0.01, 0.03, 0.06, 0.1))
        s.world = r.choice((1, 2))
        s.restart_at = r.choice((None, None, 5.0, 20.0))
        return s


class World:
    """One schedule: build, run, check (see the module docstring)."""

    def __init__(self, seed: int, settings: Settings, chooser: Chooser, tmp: Path) -> None:
        self.seed = seed
        self.s = settings
        self.chooser = chooser
        self.tmp = tmp
        self.kernel = Kernel(self._pick, self._on_point)
        self.layout = CheckpointLayout(tmp / "run")
        for d in (self.layout.checkpoints, self.layout.staging):
            d.mkdir(parents=True, exist_ok=True)
        self.bucket = MemoryBucket(self._s3_point)
        self.remote: Remote | None = None
        if settings.store == "bucket":
            self.remote = Remote(root=S3Url("sim", "runs/r1"), cache_dir=self.layout.run_dir)
        self.policy = CommitPolicy(
            world_size=settings.world,
            marker_deadline_s=5.0,
            poll_interval_s=2.0,
            keep_last=settings.keep_last,
            lease_s=LEASE_S,
        )
        self.faults: list[str] = []
        self.faults_off = False
        self.readf = ReadFaults(self)
        self.damaged_copies: set[harm.Copy] = set()  # copies of steps (step, attempt) the schedule damaged
        self.garbled: dict[str, harm.Copy] = {}  # a record damaged in place -> the copy it belongs to
        self.garbled_bytes: dict[str, bytes] = {}  # a record damaged in place -> the bytes written there
        self.staged_copies: list[harm.Copy] = []  # copies staged whole, in order
        self.resaved: list[harm.Copy] = []  # copies the restarted job saved again
        self.writer_done = False
        self.ever_ok: set[harm.Copy] = set()
        self.retired: set[harm.Copy] = set()
        self.last_ok = 0
        self.max_epoch = 0
        self.lease_history: dict[str, list[bytes]] = {}
        self.lease_listings: list[tuple[str, ...]] = [()]
        self.holders: dict[str, Any] = {}  # proc name -> its CommitterLease once acquired
        self.renewed: dict[str, float] = {}  # proc name -> virtual time of its last lease write that landed
        self.paused_until: dict[str, float] = {}
        self.violations: list[str] = []
        self.acts: list[str] = []
        self.ended: dict[str, str] = {}
        self._checked: Any = None
        self._dirty = False
        self._verified: dict[Any, bool] = {}
        self.waits = 0
        self.resuming = False  # the restarted trainer decides where it resumes from: its reads meet faults too
        self.resumes: list[str] = []  # what it decided (a step, or why it could not)
        self.damages = 0
        self.recovered: set[str] = set()
        self.acquired: dict[str, float] = {}
        self.final_ok: list[int] = []
        self.final_reader: tuple[str, int, str] = ("none", 0, "")
        self.final_latest: int | None = None

    # -- the stores, as each actor sees them --------------------------------------------------------------------

    def raw_store(self) -> Any:
        if self.remote is not None:
            return BucketCheckpoints(self.layout, self.remote)
        return PosixCheckpoints(self.layout)

    def store_for(self, proc: str) -> Any:
        return _PointStore(self, self.raw_store(), proc)

    def _s3_point(self, op: str, key: str) -> None:
        at = f"{op} {key}"
        f = self.kernel.point(at)
        if op in S3_READS:
            self.readf.s3(op, key)  # a burst begun here (or before) fails it, as the client's spent retries do
        self._apply(f, at)

    def _apply(self, f: Fault | None, at: str) -> None:
        if f is None:
            return
        if f.kind == "eio":
            raise_eio(at)

    # -- the actors ---------------------------------------------------------------------------------------------

    def build(self) -> None:
        k = self.kernel
        s = self.s
        if s.steps:
            w = k.proc("writer", "node0")
            k.spawn(w, "", self._writer)
        if s.ghost:
            g = k.proc("ghost", s.hosts.get("ghost", "node1"), s.skews.get("ghost", 0.0))
            k.spawn(g, "", lambda: self._committer("ghost", takeover=False, start=0.0, passes=s.ghost_passes))
        if s.live_at is not None:
            live = k.proc("live", s.hosts.get("live", "node2"), s.skews.get("live", 0.0))
            k.spawn(live, "", lambda: self._committer("live", takeover=True, start=s.live_at or 0.0))
        if s.newcomer_at is not None:
            n = k.proc("newcomer", s.hosts.get("newcomer", "node3"), s.skews.get("newcomer", 0.0))
            k.spawn(n, "", lambda: self._committer("newcomer", takeover=False, start=s.newcomer_at or 0.0))

    def _writer(self) -> None:
        try:
            for step in self.s.steps:
                self.kernel.sleep(self.s.write_every)
                self.save(step, "a1")
            if self.s.restart_at is not None:
                self._restart(self.s.restart_at)
        finally:
            self.writer_done = True

    def _restart(self, after: float) -> None:
        """The training job restarts: its rank 0's committer (appointed) starts and recovers, the trainer then
        decides where it resumes from (the library's :func:`~pipeline.checkpoint.resume.decide`, through its own
        view of the store, where reads fail too) and saves every step above it again, as attempt ``a2`` (a
        fall-back meanwhile: the steps it lost are saved anew). It never resumes from a step older than the newest
        copy staged whole and not damaged; a resume it cannot decide stops it in one line."""
        k = self.kernel
        newest = self.s.steps[-1]
        k.block("restart.after", ready=lambda: any(c[0] == newest for c in self.ever_ok), until=k.now + after)
        ok = self.ok_steps()
        if not ok and not self.chooser.chance(0.25):
            return  # nothing committed yet: the job mostly ends as planned (a restart costs a third of a schedule)
        if ok and self.damages < 2 and not self.faults_off and self.chooser.chance(0.8):  # what made it restart
            kinds = [t for t in ("data", "manifest") if f"damage-{t}" not in os.environ.get("SIM_SKIP", "")]
            target = kinds[self.chooser.choose(len(kinds))]
            what = harm.damage(self, target, ok[-1], garbage=self.chooser.choose(2) == 1)
            self.damages += 1
            self.faults.append(f"damage-{target} {what} at t={k.now:.1f} (before the training job restarts)")
        p = k.proc("restart", "node0")
        k.spawn(p, "", lambda: self._committer("restart", takeover=True, start=0.0))
        k.block("restart.recovered", ready=lambda: "restart" in self.recovered or "restart" in self.ended,
                until=k.now + 3 * LEASE_S)  # fmt: skip
        self.resuming = True
        try:
            floor = resume.decide(self.layout, self.policy.world_size, deadline_s=RESUME_S, remote=self.remote,
                                  committer_alive=lambda: "restart" not in self.ended)  # fmt: skip
        finally:
            self.resuming = False
        if isinstance(floor, str):
            self.resumes.append(floor)
            return  # the trainer cannot resume (a read that keeps failing, a damaged step): it stops, in one line
        self.resumes.append(f"step {floor}")
        with k.outside():
            self._check_trainer(floor)
        for step in [s for s in self.s.steps if s > floor]:
            self.kernel.sleep(self.s.write_every)
            self.save(step, "a2")
            self.resaved.append((step, "a2"))

    def _check_trainer(self, floor: int) -> None:
        """The restarted trainer resumes from ``floor``: never older than the newest copy staged whole (or committed)
        and not damaged or retired since."""
        trashed = self.trashed()
        gone = self.damaged_copies | self.retired
        whole = [c[0] for c in self.staged_copies if c not in gone and c[0] not in trashed]
        if floor < max(whole, default=0):
            self.violate(
                f"the restarted trainer resumes from step {floor} (resume.decide), yet step {max(whole)} was staged "
                f"whole and nothing damaged it{self._read_faults_note()}"
            )

    def resume_floor(self) -> int | None:
        """The step a resuming trainer starts from (the newest committed step, or a staged one it waits for);
        None when it cannot resume."""
        kind, step, _ = self.reader()
        if kind == "fail":
            return None
        try:
            waits = stores.uncommitted(self.raw_store(), self.policy.world_size)
        except (OSError, PipelineError):
            return None
        return max([step if kind == "ok" else 0, *waits])

    def save(self, step: int, attempt: str) -> None:
        """Every rank stages its files of ``step`` and then its marker, the ranks in an order the schedule picks;
        the copy counts as staged whole once the last marker is written."""
        ranks = list(range(self.s.world))
        if len(ranks) > 1 and self.chooser.choose(2):
            ranks.reverse()
        for rank in ranks:
            self.stage_rank(step, rank, attempt)
        self.staged_copies.append((step, attempt))

    def stage(self, step: int, attempt: str = "a1") -> None:
        for rank in range(self.s.world):
            self.stage_rank(step, rank, attempt)

    def stage_rank(self, step: int, rank: int, attempt: str) -> None:
        """What one rank's save does, without torch: its files (bytes of this attempt's own) and then its marker, in
        the staged step (a directory) or uploaded from a scratch dir (a bucket: ``rank_save.finish``)."""
        world = self.s.world
        rels = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 and self.remote is None else [])
        if self.remote is not None:
            where = self.tmp / "upload" / f"step_{step}-{attempt}-{rank}"
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
        else:
            where = self.layout.staged_step(step)
            where.mkdir(parents=True, exist_ok=True)  # idempotent mkdir of a planned dir: safe from every rank
            clear_file(marker_path(where, rank))  # its own marker of an older attempt
        for rel in rels:
            write_bytes_atomic(where / rel, payload(step, rank, rel, attempt))
        entries = tuple(describe(where, rel) for rel in rels)
        marker = Marker(step=step, rank=rank, world_size=world, format=TEST_FORMAT, attempt=attempt, files=entries)
        if self.remote is not None:
            self.remote.upload_rank(where, marker)
        else:
            write_marker(where, marker)

    def _committer(self, name: str, *, takeover: bool, start: float, passes: int | None = None) -> str:
        if start:
            self.kernel.sleep(start)
        c = Committer(self.layout, self.policy, self.store_for(name))
        try:
            with c.hold(takeover):
                self.holders[name] = c.lease
                self.acquired[name] = self.kernel.now  # (renewed: when its last write of its record began)
                self.renewed.setdefault(name, self.kernel.now)
                if name == "newcomer":  # judged at the admission: the look itself is no point where time passes
                    with self.kernel.outside():
                        self._check_admission(name)
                c.recover()
                self.recovered.add(name)
                if passes is not None:
                    for _ in range(passes):
                        c.commit_ready()
                else:
                    c.follow(lambda: not self.writer_done)
            self.ended[name] = "done"
        except CommitterBusy:
            self.ended[name] = "refused"
        except CommitterLost:
            self.ended[name] = "lost"
        except Killed:
            self.ended[name] = "killed"
            raise
        except (PipelineError, OSError) as e:
            self.ended[name] = f"{type(e).__name__}: {e}"[:200]
        return self.ended.get(name, "")

    # -- the scheduler's choices -------------------------------------------------------------------------------

    def _pick(self, k: Kernel, ready: list[Actor]) -> Actor | None:
        runnable = [a for a in ready if self.paused_until.get(a.proc.name, -1.0) <= k.now or a.proc.dead]
        if not runnable:  # every runnable actor's process is paused: time passes until the first actor wakes, a
            # paused one or a sleeping one of another process (not past it: its sleep would end late)
            wakes = [self.paused_until[a.proc.name] for a in ready]
            wakes += [
                a.wake_at for a in k.actors if a.state == "blocked" and a.wake_at is not None and a.wake_at > k.now
            ]
            k.now = max(k.now, min(wakes))
            return None
        return runnable[self.chooser.choose(len(runnable))]

    def _on_point(self, k: Kernel, a: Actor) -> bool:
        if self._dirty or a.at == "start":  # what the last operation let run changed, checked before the next
            self._dirty = False
            self.check()
        go = self._fault(k, a)
        if go and visible(a.at):
            self._dirty = True
            if a.proc.name != "writer":
                k.trace.append(f"t={k.now:.1f} {a.name}: {a.at.replace(str(self.layout.checkpoints), '')}")
        return go

    def _fault(self, k: Kernel, a: Actor) -> bool:
        """Maybe inject a fault where ``a`` stands; whether ``a`` runs now."""
        if self.faults_off or len(self.faults) >= self.s.max_faults:
            return True
        if a.proc.name == "writer" and not self.resuming:
            return True
        if not a.at.startswith(FAULT_POINTS) or not self.chooser.chance(self.s.fault_rate):
            return True
        kinds = [x for x in self.s.kinds for _ in range(KIND_WEIGHTS.get(x, 1)) if self._applies(x, a)]
        if a.proc.name == "writer":  # the trainer's resume: its reads fail, nothing else happens to it there
            kinds = [x for x in kinds if x in ("readfail", "torn", "short")]
        if not kinds:
            return True
        kind = kinds[self.chooser.choose(len(kinds))]
        return self.inject(kind, a)

    def _applies(self, kind: str, a: Actor) -> bool:
        at = a.at
        if kind == "torn":
            return at.startswith(("lease.get", RECORD_AT))
        if kind == "short":
            return at.startswith(RECORD_AT)
        if kind == "readfail":
            return at.startswith(READ_POINTS)
        if kind == "stale":
            return at.startswith(("lease.get", "lease.names"))
        if kind == "eio":  # a failed write (a bucket's requests fail as StoreError: readfail)
            return at.startswith(("io ", "lease.")) or (at.startswith("s3.") and not at.startswith(S3_READS))
        if kind == "kill":
            return not any(f.startswith("kill") for f in self.faults)
        if kind == "damage":  # once a step is committed (the ranks' markers, a lease record, too)
            return self.damages < 2 and bool(self.ok_steps())
        return True

    def inject(self, kind: str, a: Actor) -> bool:
        """Inject ``kind`` where ``a`` stands; False when ``a`` does not run now (paused, killed)."""
        k = self.kernel
        where = f"{a.name} at {a.at}"
        if kind == "pause":
            d = (0.5, 1.2, 2.5)[self.chooser.choose(3)] * LEASE_S
            self.paused_until[a.proc.name] = k.now + d
            a.state = "blocked"
            a.wake_at = k.now + d
            self.faults.append(f"pause {a.proc.name} {d:g} s at t={k.now:.1f}: {where}")
            return False
        if kind == "kill":
            k.kill(a.proc)
            self.faults.append(f"kill {a.proc.name} at t={k.now:.1f}: {where}")
            return True
        if kind == "damage":
            found = [(t, x) for t in harm.TARGETS for _ in range(harm.WEIGHTS[t]) if (x := harm.targets(self, t))]
            if not found:
                return True
            target, options = found[self.chooser.choose(len(found))]
            what = harm.damage(self, target, options[self.chooser.choose(len(options))], self.chooser.choose(2) == 1)
            self.damages += 1
            self.faults.append(f"damage-{target} {what} at t={k.now:.1f} (while {where})")
            return True
        if kind == "readfail":
            self.begin_read_fault(a, a.at)
            return True
        if kind in ("torn", "short") and a.at.startswith(RECORD_AT):
            length = TEAR_S[self.chooser.choose(len(TEAR_S))]
            self.readf.begin_tear(a.proc.name, a.at[len(RECORD_AT) :], length, short=kind == "short")
            self.faults.append(f"{kind}-record {length:g} s at t={k.now:.1f}: {where}")
            return True
        a.fault = Fault(kind)
        self.faults.append(f"{kind} at t={k.now:.1f}: {where}")
        return True

    def begin_read_fault(self, a: Actor, at: str, aside: bool = False) -> None:
        """A burst of failed reads of ``a``'s process begins at ``at`` (:mod:`tests.sim.read_faults`)."""
        if at.startswith("lease."):  # the lease store's whole mount, or connection
            errs: tuple[str, ...] = ("timeout",) if self.remote is not None else ("EIO",)
        else:
            errs = burst_errors(at)
        err = errs[self.chooser.choose(len(errs))]
        length = BURST_S[self.chooser.choose(len(BURST_S))]
        path = None
        if err in ("ESTALE", "5xx"):  # one path's, one key's
            path = at.split(" ", 2)[2] if at.startswith("read ") else at.split(" ", 1)[1]
        self.readf.begin_burst(a.proc.name, err, length, path)
        outlasts = "-outlasting" if length >= reads.READ_RETRY_S else ""
        shown = at.replace(str(self.layout.checkpoints), "")
        self.faults.append(f"read-{err}{outlasts} {length:g} s at t={self.kernel.now:.1f}: {a.name} at {shown}"
                           + (" (aside)" if aside else ""))  # fmt: skip

    def draw_aside(self, a: Actor, at: str) -> None:
        """A read run aside for ``a`` (a pool's transfer): no point, but a burst may begin there."""
        if self.faults_off or len(self.faults) >= self.s.max_faults or "readfail" not in self.s.kinds:
            return
        if self.chooser.chance(self.s.fault_rate):
            self.begin_read_fault(a, at, aside=True)

    def touched(self) -> None:
        """The world was changed from outside the processes (damage): every invariant looks again."""
        self._checked = None
        self._dirty = True
        self._verified.clear()

    def damage(self, step: int) -> None:
        """Flip a byte of ``step``'s data file (a disk's or an operator's doing, not the protocol's)."""
        copy = harm.copy_at(self, step) or (step, "a1")
        self.damaged_copies.add(copy)
        self.touched()
        if self.remote is not None:
            objs = self.bucket.objects.setdefault("sim", {})
            key = f"runs/r1/step_{step}/{copy[1]}/__0_0.distcp"
            data, etag = objs[key]
            objs[key] = (bytes([data[0] ^ 0xFF]) + data[1:], etag + "x")
            return
        path = self.layout.committed_step(step) / "__0_0.distcp"
        data = path.read_bytes()
        path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])

    def lease_fault(self, proc: str) -> str | None:
        """A fault every lease operation of ``proc`` meets (a directed plan arms one)."""
        return None

    def finish_writer(self) -> None:
        self.writer_done = True

    def stage_now(self, *steps: int, attempt: str = "a1") -> None:
        """Stage ``steps`` at once (from outside the processes: the writer of a directed plan)."""
        for step in steps:
            self.stage(step, attempt)
            self.staged_copies.append((step, attempt))
            self.damaged_copies.discard((step, attempt))  # a new copy of the step

    @property
    def staged_done(self) -> list[int]:
        """The steps staged whole (any attempt), in order."""
        return [s for s, _ in self.staged_copies]

    @property
    def damaged(self) -> set[int]:
        """The steps a copy of which the schedule damaged."""
        return {s for s, _ in self.damaged_copies}

    # -- the invariants ---------------------------------------------------------------------------------------

    def present(self) -> list[int]:
        try:
            return self.raw_store().committed()
        except (OSError, PipelineError):
            return []

    def verifies(self, step: int) -> bool:
        key = (step, self._step_print(step))
        if key not in self._verified:
            try:
                self.raw_store().verify_committed(step)
                self._verified[key] = True
            except (VerificationError, OSError, StoreError):
                self._verified[key] = False
        return self._verified[key]

    def _step_print(self, step: int) -> Any:
        if self.remote is not None:
            prefix = f"runs/r1/step_{step}/"
            return tuple(
                sorted((k, v[1]) for k, v in self.bucket.objects.get("sim", {}).items() if k.startswith(prefix))
            )
        try:
            d = self.layout.committed_step(step)
            return tuple(sorted((e.name, e.inode(), e.stat(follow_symlinks=False).st_mtime_ns) for e in os.scandir(d)))
        except OSError:
            return None

    def ok_steps(self) -> list[int]:
        return [s for s in self.present() if self.verifies(s)]

    def reader(self) -> tuple[str, int, str]:
        """What a reader resumes from: ('ok', step), ('none', 0), or ('fail', step it took, why)."""
        step = -1
        try:
            if self.remote is not None:
                newest = getattr(self.remote, "newest_manifest", None)  # 79e094b's readers: latest as written
                found = newest() if newest is not None else self.remote.verified_latest()
                if found is None:
                    return "none", 0, ""
                step = found[0].step
            else:
                latest = read_newest(self.layout)
                if latest is None:
                    return "none", 0, ""
                step = latest.step
        except (VerificationError, OSError, StoreError) as e:
            return "fail", step if step >= 0 else self._named(), str(e)[:300]
        if not self.verifies(step):
            return "fail", step, f"step {step}, which a reader resumes from, does not verify"
        return "ok", step, ""

    def _named(self) -> int:
        try:
            named = self.raw_store().latest_named()
        except (VerificationError, OSError, StoreError):
            return -1
        return named if named is not None else -1

    def violate(self, what: str) -> None:
        self.violations.append(f"t={self.kernel.now:.1f}: {what}")
        raise Violation(what)

    def fingerprint(self) -> tuple[Any, Any]:
        """What the invariants depend on, cheaply, in two parts: the steps (every committed entry, ``latest``,
        the trash: each entry's inode, as every file there is written by a rename, or not at all) and the lease's
        records (inode, size and mtime); in a bucket, the objects' ETags. A part unchanged since the last check
        needs no check: a heartbeat changes only the lease's part."""
        steps: list[Any] = []
        lease: list[Any] = []
        if self.remote is not None:
            for k, v in sorted(self.bucket.objects.get("sim", {}).items()):
                (lease if "/committer/" in k else steps).append((k, v[1]))
            return tuple(steps), tuple(lease)
        top = str(self.layout.checkpoints)
        records = top + "/committer"
        stack = [top]
        while stack:
            d = stack.pop()
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            root = d == top
            for e in entries:
                if (e.name == "staging" and root) or ".tmp-" in e.name:
                    continue  # a temp file changes nothing a reader or the lease holder sees
                if d == records or (root and e.name.startswith(ownership.LEASE)):
                    st = e.stat(follow_symlinks=False)
                    lease.append((e.path, st.st_ino, st.st_size, st.st_mtime_ns))
                else:  # written by temp + rename (a new inode) or not at all; damage() says so itself
                    steps.append((e.path, e.inode()))
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
        return tuple(sorted(steps)), tuple(sorted(lease))

    def trashed(self) -> set[int]:
        """Retired steps a late retention moved that can still come back (a directory's trash)."""
        found = getattr(self.raw_store(), "trashed", None)
        return set(found()) if found is not None else set()

    def check(self) -> None:
        fp = self.fingerprint()
        before, self._checked = self._checked, fp
        if before is None or fp[0] != before[0]:
            self._check_steps()
        if before is None or fp[1] != before[1]:
            self._check_lease()

    def _check_steps(self) -> None:
        kind, step, why = self.reader()
        listed = self.present()
        ok = [s for s in listed if self.verifies(s)]
        copies = {s: harm.copy_at(self, s) for s in listed}
        trashed = self.trashed()
        if kind == "fail" and step in trashed:
            self.waits += 1  # told to resume again once the committer brings the step back: an error, never a regress
        elif kind == "fail" and not self._may_fail(step, copies.get(step)):
            self.violate(f"a reader cannot resume: {why}{self._read_faults_note()}")
        if kind == "none" and ok and "none" not in os.environ.get("SIM_SKIP", ""):
            self.violate(f"a reader finds no latest, yet committed step(s) {ok} verify{self._read_faults_note()}")
        self._check_resume(kind, step, trashed)
        if kind == "ok":
            between = sorted(c for c in self.ever_ok if step < c[0] <= self.last_ok)
            if step < self.last_ok and not all(c in self.damaged_copies or c in self.retired for c in between):
                self.violate(
                    f"latest went back from step {self.last_ok} to {step}, and nothing damaged or retired the "
                    f"cop(ies) between ({_shown(between)}){self._read_faults_note()}"
                )
            self.last_ok = step
        present = set(listed)
        for c in sorted(self.ever_ok - self.damaged_copies - self.retired):
            s = c[0]
            if s in trashed:
                continue
            if copies.get(s) == c:
                if s not in ok:
                    self.violate(
                        f"step {s} ({c[1]}) verified, is still committed, and no longer verifies though nothing "
                        "damaged it"
                    )
                continue
            newer = [t for t in present if t > s]  # damaged ones too: retention does not verify (the committer does)
            if len(newer) < self.s.keep_last:
                self.violate(
                    f"step {s} ({c[1]}) verified and was removed, but retention keeps it (committed steps newer than "
                    f"it: {newer}, keep_last={self.s.keep_last}){self._read_faults_note()}"
                )
            self.retired.add(c)
        self.ever_ok |= {c for s, c in copies.items() if c is not None and s in ok}

    def _may_fail(self, step: int, copy: harm.Copy | None) -> bool:
        """Whether a reader may fail at ``step``: the copy committed there was damaged, or ``latest`` is."""
        if harm.latest_garbled(self):
            return True
        return copy in self.damaged_copies if copy is not None else step in self.damaged

    def _read_faults_note(self) -> str:
        """The read faults injected so far, for a violation's message: what made an act happen, if one of them."""
        met = [f for f in self.faults if f.startswith(("read-", "torn-", "short-"))]
        return f" [read faults so far: {'; '.join(met)}]" if met else ""

    def _check_resume(self, kind: str, step: int, trashed: set[int]) -> None:
        if kind == "fail":
            return  # the reader's own invariant judges it
        gone = self.damaged_copies | self.retired  # a step in the trash: the committer's next pass brings it back
        whole = [c[0] for c in self.staged_copies if c not in gone and c[0] not in trashed]
        if max(whole, default=0) <= (step if kind == "ok" else 0):
            return  # what it resumes from is new enough, whatever it would wait for
        try:
            waits = stores.uncommitted(self.raw_store(), self.policy.world_size)
        except (OSError, PipelineError, StoreError):
            return
        floor = max([step if kind == "ok" else 0, *waits])
        if floor < max(whole, default=0):
            self.violate(
                f"a resuming trainer would start from step {floor} ({kind} {step}, waiting for {waits}), yet step "
                f"{max(whole)} was staged whole and nothing damaged it{self._read_faults_note()}"
            )

    def _check_lease(self) -> None:
        if harm.lease_garbled(self):
            return  # a record damaged: the lease's own invariants wait until its holder writes it again
        epoch = self._lease_epoch()
        if epoch is not None:
            if epoch < self.max_epoch:
                self.violate(
                    f"the lease went back from epoch {self.max_epoch} to {epoch} (a newer holder's record overwritten)"
                )
            self.max_epoch = max(self.max_epoch, epoch)

    def _check_quarantine(self) -> None:
        """No copy of a step that verifies is in quarantine unless the schedule damaged it (judged once the
        schedule is over: a committer may move a copy there and back, finding it was not the one found bad)."""
        for copy, good, where in harm.quarantined(self):
            if good and copy not in self.damaged_copies:
                self.violate(
                    f"step {copy[0]} ({copy[1]}) verifies, nothing damaged it, and it is in {where}"
                    f"{self._read_faults_note()}"
                )

    def _lease_epoch(self) -> int | None:
        try:
            held = ownership.CommitterLease(self.raw_store().lease_store(), LEASE_S).current()
        except (OSError, PipelineError):
            return None
        return held.epoch if held is not None else None

    def _check_admission(self, name: str) -> None:
        """A newcomer was just admitted: no other holder may be live, i.e. hold the highest record besides the
        newcomer's, run (not paused, not dead) and have renewed it within most of a lease."""
        now = self.kernel.now
        mine = self.holders[name]
        ranked = getattr(ownership, "ranked", None)  # (the lease of 79e094b has one record: its holder is the top)
        if ranked is not None:
            others = [r for r in ranked(self.raw_store().lease_store()) if r[1] != mine.token]
            top = others[-1][:2] if others else None
        else:
            held = ownership.CommitterLease(self.raw_store().lease_store(), LEASE_S).current()
            top = held.rank() if held is not None else None
        if harm.lease_garbled(self):
            return  # a record damaged: who holds the lease is unknown to everyone until it is written again
        for other, lease in self.holders.items():
            if other == name or self.kernel.procs[other].dead or (lease.epoch, lease.token) != top:
                continue
            if self.paused_until.get(other, -1.0) > now:
                continue
            holds = lease.lost() is None and getattr(lease, "_mine", None) is not None
            if holds and now - self.renewed.get(other, -1e9) < LEASE_S * 0.8:
                self.violate(
                    f"{name} was admitted as committer beside {other}, which renewed its lease "
                    f"{now - self.renewed[other]:.1f} s ago"
                )

    # -- running it ---------------------------------------------------------------------------------------------

    def before(self) -> None:
        """Done first, outside the simulation (a directed plan's steps committed by a committer that came and went)."""

    def run(self) -> None:
        with _remote_store(self.bucket, self.kernel):
            self.before()
        with (
            patched(self.kernel, self.seed, PATCHED, ownership, self._apply),
            _remote_store(self.bucket, self.kernel),
            installed(self.readf),
        ):
            self.build()
            try:
                self.kernel.run()
                self.check()
                self.rerun()
                self.final_ok, self.final_reader = self.ok_steps(), self.reader()
                self.final_latest = self.raw_store().latest_named()
            except Violation:
                pass
            except Stuck as e:
                self.violations.append(f"stuck: {e}")
            finally:
                self.kernel.shutdown()
        for a in self.kernel.actors:
            if a.error is not None and not isinstance(a.error, Violation):
                self.violations.append(f"{a.name} failed: {type(a.error).__name__}: {a.error}")

    def rerun(self) -> None:
        """A committer started afresh, no faults: finishes, and ``latest`` names the newest step it should."""
        self.faults_off = True
        self.paused_until.clear()
        k = self.kernel
        k.free = True  # (checked once it is done)
        self._checked = None
        p = k.proc("rerun", "node9")
        k.spawn(p, "", lambda: self._committer("rerun", takeover=True, start=2 * LEASE_S, passes=1))
        k.run()
        self.check()
        if self.ended.get("rerun") != "done":
            self.violate(f"a rerun did not finish: {self.ended.get('rerun')}")
        expected = [c[0] for c in self.staged_copies if c not in self.damaged_copies and c not in self.retired]
        kind, step, why = self.reader()
        want = max(expected, default=0)
        # A retired step whose purge was cut short keeps its objects: committed again, it is the newest that verifies
        back = kind == "ok" and any(c[0] == step for c in self.retired) and step > want and self.verifies(step)
        # A copy damaged where its verification does not look (a committed step's marker in a bucket) still verifies
        back = back or (kind == "ok" and step > want and harm.copy_at(self, step) in self.damaged_copies)
        if (step if kind == "ok" else 0) != want and not back:
            self.violate(
                f"after a rerun a reader resumes from {kind} {step} {why}, expected step {want}"
                f"{self._read_faults_note()}"
            )
        self._check_quarantine()


def _shown(copies: Iterable[harm.Copy]) -> str:
    return ", ".join(f"{s} ({a})" for s, a in copies)


class _PointStore:
    """The store as one committer sees it: each call of the store interface is a point of the scheduler."""

    def __init__(self, world: World, store: Any, proc: str) -> None:
        self._w = world
        self._store = store
        self._proc = proc

    def lease_store(self) -> Any:
        return _PointLease(self._w, self._store.lease_store())

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr) or name in ("opened",):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            at = f"store.{name}"
            self._w._apply(self._w.kernel.point(at), at)
            return attr(*args, **kwargs)

        return call


class _PointLease:
    """The lease records' store as a committer sees it: every listing, read and write is a point; a read can come
    back torn or stale (an older listing, an older record), any of them can fail with ``EIO``."""

    def __init__(self, world: World, lease: Any) -> None:
        self._w = world
        self._lease = lease
        self.where = lease.where

    def _point(self, at: str) -> Fault | None:
        f = self._w.kernel.point(at)
        a = self._w.kernel.current()
        armed = self._w.lease_fault(a.proc.name) if a is not None and f is None else None
        if armed == "unreadable":  # the lease cannot be read: a listing fails, a record reads torn
            f = Fault("eio") if at in ("lease.names",) else Fault("torn")
        elif armed == "stale" and at in ("lease.names", "lease.get"):  # a view that stays stale (a mount's cache)
            f = Fault("stale")
        if f is not None and f.kind == "eio":
            raise_eio(at)
        return f

    def names(self) -> list[str]:
        f = self._point("lease.names")
        got: list[str] = self._lease.names()
        if f is not None and f.kind == "stale" and len(self._w.lease_listings) >= 2:
            return list(self._w.lease_listings[-2])
        return got

    def get(self, name: str) -> bytes | None:
        f = self._point("lease.get")
        got: bytes | None = self._lease.get(name)
        if f is not None and got is not None:
            if f.kind == "torn":
                return got[: len(got) // 2]
            older = self._w.lease_history.get(name, [])
            if f.kind == "stale" and len(older) >= 2:
                return older[-2]
        return got

    def put(self, name: str, data: bytes, create: bool) -> bool:
        began = self._w.kernel.now  # a write frozen on its way lands late: its holder renewed when it began
        self._point("lease.put")
        ok: bool = self._lease.put(name, data, create)
        w = self._w
        a = w.kernel.current()
        if ok and a is not None:
            w.renewed[a.proc.name] = began
            w.lease_history.setdefault(name, []).append(data)
            if create:
                w.lease_listings.append(tuple(self._lease.names()))
        return ok

    def delete(self, name: str) -> None:
        self._point("lease.delete")
        self._lease.delete(name)

    def __getattr__(self, name: str) -> Any:
        """The lease of 79e094b (one record read and replaced whole): ``read`` and ``write`` as points too."""
        attr = getattr(self._lease, name)
        w = self._w

        def call(*args: Any, **kwargs: Any) -> Any:
            f = self._point(f"lease.{name}")
            got = attr(*args, **kwargs)
            if name == "read" and f is not None and f.kind in ("torn", "stale") and got[0] is not None:
                return (got[0][: len(got[0]) // 2], *got[1:])
            if name == "write" and got:
                a = w.kernel.current()
                if a is not None:
                    w.renewed[a.proc.name] = w.kernel.now
            return got

        return call


class _remote_store:
    """Every :class:`Remote` of the world reads and writes the bucket in memory; its transfer pools run in the
    caller's greenlet, as a thread of their own would see the kernel (no points, no actor: ``Kernel.aside``)."""

    def __init__(self, bucket: MemoryBucket, kernel: Kernel) -> None:
        self.bucket = bucket
        self.kernel = kernel

    def __enter__(self) -> None:
        self.saved = remote.S3Store, PosixStorage.exclusive, remote.cf
        remote.S3Store = self.bucket.store  # type: ignore[assignment,misc]
        PosixStorage.exclusive = _granted  # type: ignore[method-assign,assignment]  # as across two mounts
        remote.cf = _InlinePools(self.kernel)  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        remote.S3Store, PosixStorage.exclusive, remote.cf = self.saved  # type: ignore[misc,method-assign]


class _InlinePools:
    """``concurrent.futures`` for :mod:`remote`: a pool whose work runs at once, in the caller's greenlet but
    aside from its actor, exactly as the pool's threads ran it (the kernel sees no actor there, so no point is a
    choice and no fault lands), without a thread started per transfer (a tenth of a bucket schedule's time)."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel

    def ThreadPoolExecutor(self, *args: Any, **kwargs: Any) -> _InlinePool:  # noqa: N802 - the name it replaces
        return _InlinePool(self.kernel)


class _InlinePool:
    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel

    def __enter__(self) -> _InlinePool:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        f: cf.Future[Any] = cf.Future()
        with self.kernel.aside():
            try:
                f.set_result(fn(*args))
            except Exception as e:  # noqa: BLE001 - kept in the future, as a pool keeps it
                f.set_exception(e)
        return f

    def map(self, fn: Callable[..., Any], items: Iterable[Any]) -> Iterator[Any]:
        return iter([self.submit(fn, x).result() for x in items])


@contextlib.contextmanager
def _granted(self: Any, path: Path) -> Iterator[bool]:
    """``flock`` as two FUSE mounts of one filesystem grant it: to everyone."""
    yield True


def scratch_root() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="sim-", dir=shm if shm.is_dir() else None))


def run_one(seed: int, store: str, settings: Settings | None = None, script: list[int] | None = None,
            root: Path | None = None) -> World:  # fmt: skip
    """Run the schedule of ``seed`` (or of ``script``, its choices) on ``store``; the world, violations in it."""
    base = root or scratch_root()
    tmp = base / f"s{seed}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        w = World(seed, settings or Settings.draw(seed, store), Chooser(seed, script), tmp)
        w.run()
        return w
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if root is None:
            shutil.rmtree(base, ignore_errors=True)


__all__ = ["Settings", "Violation", "World", "errno", "run_one", "Callable", "Proc"]
