"""Supervising a launch's jobs: submit each stage once its dependencies allow, poll the jobs, report each as it
ends, start the committer again when it ends while train runs, and handle interrupts.

The committer (verify-manifest) runs beside train and is the only task that commits. One that dies while
train runs (a kill, the OOM killer, a lost node) would leave every later step staged but uncommitted until the
next launch, and a requeued train waiting for it; so the launcher starts it again, at most
:data:`RESTARTS_PER_LAUNCH` times per launch, and says so. It starts again too when it dies without a verdict
after train has ended (its last pass). One that failed with an error of its own once train's record has ended
(a quarantined step, a step that cannot complete) has given its verdict: that failure stands. On SLURM the jobs
queued after the ended committer (``afterok`` on it) are cancelled and queued again after the new one.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pipeline.stagekit.checkpoint_store as storage
from pipeline.checkpoint.manifest import read_latest
from pipeline.config.schema import PipelineConfig
from pipeline.driver.lease import RunLease
from pipeline.driver.plan import Plan, PlannedStage
from pipeline.driver.progress import StageProgress, commit_lines
from pipeline.errors import PipelineError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import JobRef, Resources, StageContract
from pipeline.stagekit.jobs import Requeue
from pipeline.stagekit.records import ghost_result, has_verdict, now_iso, read_record, resume_command, write_record

Say = Callable[[str], None]

RESTARTS_PER_LAUNCH = 3
"""How many times one launch starts the committer again after it ended while train ran (or died in its last
pass). Past that its failure stands and the next launch commits what is staged."""

_ENDED = ("succeeded", "failed", "interrupted")
"""Statuses of a stage record whose attempt has ended (``running`` and ``requeued`` have not)."""


@dataclass(frozen=True)
class StageJob:
    """One stage launch: everything a launcher needs, decided by the plan before the job starts."""

    stage: str
    contract: StageContract
    cfg: PipelineConfig
    layout: RunLayout
    attempt: str
    tasks: int = 1
    resources: Resources = field(default_factory=Resources)
    beside: JobRef | None = None
    """The job this one runs beside (the committer gets train's), decided by the runner at submission."""

    @staticmethod
    def of(planned: PlannedStage, plan: Plan, beside: JobRef | None = None) -> StageJob:
        return StageJob(
            planned.name,
            planned.contract,
            plan.cfg,
            plan.layout,
            planned.launch_id,
            planned.tasks,
            planned.resources,
            beside,
        )


class JobWatch(Protocol):
    """What a launcher reports while it runs a job: the job id once submitted, and a poll per wait tick."""

    def started(self, job_id: str, cluster: str, folder: Path) -> None: ...

    def poll(self) -> None: ...


class JobHandle(Protocol):
    """A submitted stage job."""

    job_id: str
    folder: Path

    def poll(self) -> bool:
        """True once the job has ended. Raises ``StageFailedError`` when the launcher gives up on it (a deadline,
        a task that ended while its peers hang); the runner then cancels it."""
        ...

    def outcome(self) -> None:
        """After ``poll`` said done: return if every task succeeded, else raise ``StageFailedError``."""
        ...

    def requeued(self) -> Requeue | None:
        """Once per requeue: the scheduler queued the job again after a run ended (a node failure, a preemption);
        the launcher has let it start as soon as it can. None otherwise (always, for a local job)."""
        ...

    def cancel(self, wait: bool = True) -> None:
        """Cancel the job and (``wait``) wait, bounded by ``launcher.cancel_timeout_s``, until its processes are
        gone. ``wait=False`` only asks (so several jobs are cancelled at once, before a dependency lets one start)."""
        ...


class JobLauncher(Protocol):
    """What the runner needs of a launcher (``launchers.base.Launcher`` and its kinds): it submits stage jobs.
    A ``chains`` launcher (SLURM) takes every job of a plan at once, each with its dependencies (``after``: the
    kind and handle of each); the others get a job only once its dependencies have ended (or started, beside)."""

    cluster: str
    chains: bool

    def submit(self, job: StageJob, after: Sequence[tuple[str, JobHandle]] = ()) -> JobHandle: ...


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, not an error of the pipeline
    """Ctrl-C, SIGTERM or SIGHUP reached the launching process."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(signal.Signals(signum).name)


def latest_text(layout: RunLayout, cfg: PipelineConfig | None = None) -> str:
    """``step N``, ``none`` or ``unreadable (...)``: ``latest`` as the console says it (with ``cfg``: the
    bucket's, for ``checkpoint.storage``)."""
    try:
        if cfg is not None and cfg.checkpoint.storage:
            latest = storage.committed_latest(cfg, layout)
        else:
            latest = read_latest(layout) if layout.latest.exists() else None
    except (PipelineError, OSError, ValueError) as e:
        return f"unreadable ({e})"
    return f"step {latest.step}" if latest else "none"


def downstream(plan: Plan, name: str) -> list[PlannedStage]:
    """The stages of ``plan`` that need ``name``, directly or through another one, in plan order."""
    after = {name}
    found = []
    for planned in plan.stages:
        if any(n in after for n in planned.needs):
            after.add(planned.name)
            found.append(planned)
    return found


class _Watch:
    def __init__(self, planned: PlannedStage, plan: Plan, lease: RunLease, say: Say) -> None:
        self.planned, self.lease, self.say = planned, lease, say
        self.progress = StageProgress(
            plan.layout, planned.name, planned.launch_id, say, interval_s=plan.cfg.launcher.progress_interval_s
        )

    def started(self, job_id: str, cluster: str, folder: Path) -> None:
        self.lease.record_job(self.planned.name, job_id, cluster)
        self.say(f"     {self.planned.name}: job {job_id}, logs {folder}")

    def poll(self) -> None:
        self.progress.poll()


@dataclass
class _Active:
    planned: PlannedStage
    handle: JobHandle
    watch: _Watch
    t0: float
    requeued: Requeue | None = None  # SLURM's last requeue of its job, as seen


class Execution:
    """Drives the plan's jobs: submits each once its dependencies allow (all at once, with dependencies, on a
    chaining launcher such as SLURM), polls them, reports each as it ends, starts the committer again when it
    ends while train runs (see the module's docstring), and handles interrupts."""

    def __init__(
        self,
        plan: Plan,
        launcher: JobLauncher,
        lease: RunLease,
        say: Say,
        after_create: Callable[[], None] | None,
        todo: list[PlannedStage],
    ):
        self.plan, self.launcher, self.lease, self.say, self.after_create = plan, launcher, lease, say, after_create
        self.todo = todo
        """Stages still to submit, in plan order."""
        self.status: dict[str, str] = {}
        self.handles: dict[str, JobHandle] = {}
        self.times: dict[str, float] = {}
        self.active: list[_Active] = []
        self.failures: dict[str, PipelineError] = {}
        self.restarts = 0
        self.interrupting = False

    @property
    def failure(self) -> PipelineError | None:
        """The failure of the earliest stage in plan order (the cause; a committer beside a failed train may
        end, and fail, before the train failure is seen)."""
        return next((self.failures[s.name] for s in self.plan.stages if s.name in self.failures), None)

    def _ready(self, planned: PlannedStage) -> str:
        """``go``, ``wait`` (a dependency has not ended, or not started for ``beside``) or ``blocked``."""
        for need in planned.needs:
            if self.status.get(need) in ("failed", "not run"):
                if not planned.contract.after_any:
                    return "blocked"
                continue
            if need not in self.handles:
                return "wait"
            if self.launcher.chains or planned.contract.beside == need:
                continue  # the scheduler holds it until its dependency allows; or it starts beside it
            if self.status.get(need) != "succeeded" and not (planned.contract.after_any and need in self.status):
                return "wait"
        return "go"

    def _submit(self, planned: PlannedStage) -> None:
        beside = None
        if planned.contract.beside in self.handles:
            producer = next(s for s in self.plan.stages if s.name == planned.contract.beside)
            handle = self.handles[producer.name]
            beside = JobRef(producer.name, self.launcher.cluster, handle.job_id, producer.launch_id)
        after = [(planned.dependency_on(n), self.handles[n]) for n in planned.needs if n in self.handles]
        self.say(planned.describe())
        watch = _Watch(planned, self.plan, self.lease, self.say)
        t0 = time.monotonic()
        try:
            handle = self.launcher.submit(
                StageJob.of(planned, self.plan, beside), after if self.launcher.chains else ()
            )
        except PipelineError as e:
            watch.progress.close()
            self._failed(planned, e)
            return
        self.handles[planned.name] = handle
        watch.started(handle.job_id, self.launcher.cluster, handle.folder)
        self.active.append(_Active(planned, handle, watch, t0))

    def _failed(self, planned: PlannedStage, e: PipelineError) -> None:
        self.status[planned.name] = "failed"
        self.say(f"FAIL {planned.name}: {str(e).splitlines()[0]}")
        self.failures[planned.name] = e

    def submit_ready(self) -> None:
        """Submit, in plan order, every stage whose dependencies allow it now."""
        todo = self.todo
        while todo:
            verdict = self._ready(todo[0])
            if verdict == "wait":
                return
            planned = todo.pop(0)
            if verdict == "blocked":
                blocked = [n for n in planned.needs if self.status.get(n) in ("failed", "not run")]
                self.say(f"skip {planned.name}: {', '.join(blocked)} did not succeed")
                self.status[planned.name] = "not run"
                continue
            self._submit(planned)

    def poll(self) -> None:
        for act in list(self.active):
            if act not in self.active:  # a restart withdrew it (a job queued after the committer)
                continue
            try:
                done = act.handle.poll()
            except PipelineError as e:  # the launcher gave up on it (a deadline): never started again
                act.handle.cancel()
                self._end(act, e, by_itself=False)
                continue
            act.watch.poll()
            again = None if done else act.handle.requeued()
            if again is not None:
                act.requeued = again
                self.say(f"     {again.line(act.planned.name, latest_text(self.plan.layout, self.plan.cfg))}")
            if done:
                try:
                    act.handle.outcome()
                except PipelineError as e:
                    self._end(act, e)
                else:
                    self._end(act, None)

    def _end(self, act: _Active, error: PipelineError | None, *, by_itself: bool = True) -> None:
        self.active.remove(act)
        act.watch.progress.close()
        name = act.planned.name
        error = ghost_result(self.plan.layout, name, act, error, self.say) if by_itself else error
        why = self._restart_reason(act, error) if by_itself else None
        if why is not None:
            if self.restarts < RESTARTS_PER_LAUNCH:
                self._restart(act, why)
                return
            self.say(f"     {name}: not started again after {self.restarts} restart(s): job {act.handle.job_id} {why}")
        if error is not None:
            self._failed(act.planned, error)
            return
        self.times[name] = time.monotonic() - act.t0
        seconds = (read_record(self.plan.layout, name) or {}).get("seconds")
        if self.launcher.chains and isinstance(seconds, (int, float)):  # queued together: time from its record
            self.times[name] = float(seconds)
        self.status[name] = "succeeded"
        self.say(f"done {name} in {self.times[name]:.1f}s")
        if act.planned.contract.creates_run and self.after_create is not None:
            self.after_create()
        summary = (read_record(self.plan.layout, name) or {}).get("summary")
        if isinstance(summary, dict) and "committed" in summary:
            for line in commit_lines(self.plan.layout, summary):
                self.say(f"     {line}")

    def _restart_reason(self, act: _Active, error: PipelineError | None) -> str | None:
        """Why the job of ``act``, which ended by itself, is started again; None when it is not.

        Only a stage beside a producer submitted by this launch (the committer beside train), never while an
        interrupt is handled: it ended while the producer still runs (train's job is active and its record for
        this attempt has not ended), or it died without a verdict of its own (no ``failed``/``succeeded``
        record from its job: a kill)."""
        producer = act.planned.contract.beside
        if producer is None or producer not in self.handles or self.interrupting:
            return None
        layout = self.plan.layout
        running = next((a for a in self.active if a.planned.name == producer), None)
        rec = read_record(layout, producer) or {}
        ended = running is None or (rec.get("attempt") == running.planned.launch_id and rec.get("status") in _ENDED)
        run = act.requeued.restarts if act.requeued is not None else 0  # a ghost's record is an earlier run's
        verdict = has_verdict(layout, act.planned.name, act.handle.job_id, run)
        cause = str(error).splitlines()[0] if error is not None else "it succeeded early"
        if act.requeued is not None and act.requeued.nodes and not verdict:  # SLURM: "sent from wrong node"
            cause = (f"SLURM ended its requeued run (restart {act.requeued.restarts}) when the run cut off on "
                     f"{act.requeued.nodes} (a ghost) ended after its node came back ({cause})")  # fmt: skip
        if not ended:
            return f"ended while {producer} runs: {cause}"
        if error is not None and not verdict:
            return f"died in its last pass: {cause}"
        return None

    def _restart(self, act: _Active, why: str) -> None:
        """Start the committer's job again; on a chaining launcher, queue its dependents again after it."""
        self.restarts, name = self.restarts + 1, act.planned.name
        self.say(
            f"     {name}: starting it again (restart {self.restarts} of at most {RESTARTS_PER_LAUNCH} per launch): "
            f"job {act.handle.job_id} {why}"
        )
        act.handle.cancel(wait=False)  # on a scheduler: a run of it SLURM requeued meanwhile must not live on
        after = downstream(self.plan, name)
        queued = [a for a in self.active if a.planned in after]  # on the scheduler's queue, after the ended job
        for dep in reversed(queued):  # all at once, the last first (as on an interrupt)
            dep.handle.cancel(wait=False)
        for dep in queued:
            dep.handle.cancel()
            dep.watch.progress.close()
            self.active.remove(dep)
        for planned in after:
            if self.status.get(planned.name) in ("failed", "not run"):  # the scheduler cancelled it before we looked
                self.status.pop(planned.name)
                self.failures.pop(planned.name, None)
            elif not any(dep.planned is planned for dep in queued):
                continue  # not submitted yet (locally it waits for the committer's success), or done
            self.handles.pop(planned.name, None)
            if planned not in self.todo:
                self.todo.append(planned)
        order = [s.name for s in self.plan.stages]
        self.todo.sort(key=lambda s: order.index(s.name))
        self._submit(act.planned)

    def interrupted(self, intr: Interrupted) -> None:
        """Cancel every job but a committer that runs beside a cancelled job (it commits what was staged and ends
        by itself once that job is gone); wait for it unless interrupted again; then report and re-raise."""
        self.interrupting = True
        layout = self.plan.layout
        running = {a.planned.name for a in self.active}
        committers = [a for a in self.active if a.planned.contract.beside in running]
        others = [a for a in self.active if a not in committers]
        for act in reversed(others):  # all at once, the last first: a dependency must not let one start meanwhile
            act.handle.cancel(wait=False)
        for act in others:
            act.handle.cancel()
            act.watch.progress.close()
            self.active.remove(act)
            if layout.stages.is_dir():
                write_record(layout, act.planned.name, status="interrupted", signal=str(intr), ended=now_iso())
        names = ", ".join(a.planned.name for a in others) or "nothing running"
        self.say(f"INTERRUPTED {names} by {intr}: its job was cancelled and its processes are gone")
        for act in committers:
            self.say(f"     {act.planned.name} commits the steps staged before the interrupt; interrupt again to skip")
        try:
            while self.active:
                self.poll()
                time.sleep(self.plan.cfg.launcher.poll_interval_s)
        except Interrupted:
            for act in list(self.active):
                act.handle.cancel()
                act.watch.progress.close()
                self.active.remove(act)
                self.say(f"skip {act.planned.name}: interrupted again")
        where = others[0].planned.name if others else "the launch"
        self.say(
            f"interrupted in {where}; latest = {latest_text(layout, self.plan.cfg)}; resume: {resume_command(layout)}"
        )
