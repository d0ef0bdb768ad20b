"""The runner: owns a run for one launch (lease), fixes the run once, and executes the plan.

Order of a launch: decide the run dir and id → take the run's lease → check the run's identity against
``run.yaml`` → record the launch (``run.yaml``, ``.hydra/``) → compute the plan → run its stages one job at a
time → print a summary. Ctrl-C, SIGTERM and SIGHUP cancel the running job, wait (bounded) until its processes
are gone, still run the committer so complete staged steps are committed, record the stage as ``interrupted``
and end with the command that resumes the run.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Protocol

from pipeline.checkpoint.manifest import read_latest
from pipeline.config.identity import RunRecord, differences, read_run_record, recorded_changes, write_run_record
from pipeline.config.overrides import carried
from pipeline.config.schema import STAGE_ALL, PipelineConfig
from pipeline.errors import ConfigError, PipelineError, RunNotFoundError, VerificationError
from pipeline.orchestration.contract import JobRef, Resources, StageContract
from pipeline.orchestration.jobs import ACTIVE_STATES, job_alive, slurm_states
from pipeline.orchestration.lease import RunLease, read_lease
from pipeline.orchestration.plan import Plan, PlannedStage, make_plan
from pipeline.orchestration.progress import StageProgress, commit_lines
from pipeline.orchestration.records import now_iso, read_record, resume_command, sweep_record_litter, write_record
from pipeline.stages import get_stage
from pipeline.storage.atomic import write_bytes_atomic
from pipeline.storage.layout import RunLayout

if TYPE_CHECKING:
    from launchers.base import JobHandle, Launcher

Say = Callable[[str], None]


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


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, not an error of the pipeline
    """Ctrl-C, SIGTERM or SIGHUP reached the launching process."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(signal.Signals(signum).name)


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """While inside, the signals above raise :class:`Interrupted` in the main thread (restored after)."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def resolve_layout(cfg: PipelineConfig) -> RunLayout:
    if cfg.stage != STAGE_ALL and not cfg.run.id:
        raise ConfigError(f"stage={cfg.stage} reruns one stage of an existing run: add run.id=<id>")
    return RunLayout.for_run(cfg.run.root, cfg.experiment, cfg.run.id or new_run_id())


def check_identity(cfg: PipelineConfig, layout: RunLayout) -> RunRecord | None:
    """The run's record, after checking that this launch keeps the run's identity (unless it starts over)."""
    if not layout.run_yaml.exists():
        if cfg.stage != STAGE_ALL and not get_stage(cfg.stage).CONTRACT.creates_run:
            raise RunNotFoundError(f"unknown run id {layout.run_id!r}: {layout.run_yaml} does not exist")
        return None
    record = read_run_record(layout.run_yaml)
    diff = differences(cfg, record.config)
    if diff and not cfg.run.overwrite:
        raise ConfigError(
            f"run {layout.run_id} keeps the config it was created with ({'; '.join(diff)}): drop the change, "
            "start a new run (without run.id), or add run.overwrite=true to start this run over"
        )
    return record


def run(
    cfg: PipelineConfig,
    launcher: Launcher,
    say: Say = print,
    *,
    overrides: list[str] | None = None,
    hydra_files: dict[str, str] | None = None,
) -> RunLayout:
    """Launch the pipeline for ``cfg`` (raises the first failure, or :class:`Interrupted`)."""
    layout = resolve_layout(cfg)
    cfg.run.id = layout.run_id  # decided once, here; every job receives it
    t0 = time.monotonic()
    with interrupts_raise():
        layout.run_dir.mkdir(parents=True, exist_ok=True)
        layout.logs.mkdir(parents=True, exist_ok=True, mode=0o700)  # owner: this process; job folders hold pickles
        command = [sys.executable, "-m", "pipeline", *sys.argv[1:]]
        with RunLease.acquire(layout, command=command, say=say, job_state=job_alive) as lease:
            record = check_identity(cfg, layout)
            sweep_record_litter(layout)  # we hold the lease: no task of this run is alive to be writing
            plan = make_plan(cfg, layout)
            if any(s.runs for s in plan.stages):  # a launch that runs nothing writes nothing, not even .hydra/
                for name, text in (hydra_files or {}).items():
                    _write_hydra_file(layout, name, text)
            say(f"run {layout.run_id}: {layout.run_dir}")

            def record_run() -> None:
                new = carried(overrides or [])
                # One-stage reruns are one-offs: they do not change what a continuation replays.
                if record is None or (cfg.stage == STAGE_ALL and (cfg.run.overwrite or not record.matches(cfg, new))):
                    history = [] if record is None or cfg.run.overwrite else list(record.history)
                    changes = {} if record is None or cfg.run.overwrite else recorded_changes(cfg, record.config)
                    if changes:
                        history.append({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "changes": changes})
                        shown = ", ".join(f"{k} {old} -> {new_}" for k, (old, new_) in changes.items())
                        say(f"run {layout.run_id} continues with {shown} (recorded in {layout.run_yaml.name})")
                    write_run_record(layout, cfg, new, history)

            if not cfg.run.overwrite:
                record_run()
            try:
                _execute(plan, launcher, say, lease, after_create=record_run if cfg.run.overwrite else None, t0=t0)
            finally:
                _hand_over_if_jobs_live(lease, say)
    return layout


def _hand_over_if_jobs_live(lease: RunLease, say: Say) -> None:
    """Jobs this launch submitted to a scheduler that are still queued or running own the run after it exits:
    the lease stays (a later launch breaks it once the scheduler says every one has finished)."""
    deadline = time.monotonic() + 15  # a job that just ended shows COMPLETING for a moment
    while True:
        ids = [j["job_id"] for j in lease.record["jobs"] if j["cluster"] == "slurm"]
        states = slurm_states(ids)
        live = [j for j in ids if states.get(j) is None or states[j] in ACTIVE_STATES]
        if not live or any(states.get(j) != "COMPLETING" for j in live) or time.monotonic() > deadline:
            break
        time.sleep(1)
    if live:
        lease.hand_over()
        say(f"the run stays owned by job(s) {' '.join(live)} until they end")


def _write_hydra_file(layout: RunLayout, name: str, text: str) -> None:
    """Hydra's record of this launch; rewritten only when it changes (a rerun that skips writes nothing)."""
    path = layout.hydra_dir / name
    if path.is_file() and not path.is_symlink() and path.read_text() == text:
        return
    layout.hydra_dir.mkdir(exist_ok=True)
    write_bytes_atomic(path, text.encode())


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


class _Execution:
    """Drives the plan's jobs: submits each once its dependencies allow (all at once, with dependencies, on a
    chaining launcher such as SLURM), polls them, reports each as it ends, and handles interrupts."""

    def __init__(
        self, plan: Plan, launcher: Launcher, lease: RunLease, say: Say, after_create: Callable[[], None] | None
    ):
        self.plan, self.launcher, self.lease, self.say, self.after_create = plan, launcher, lease, say, after_create
        self.status: dict[str, str] = {}
        self.handles: dict[str, JobHandle] = {}
        self.times: dict[str, float] = {}
        self.active: list[_Active] = []
        self.failures: dict[str, PipelineError] = {}

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

    def submit_ready(self, todo: list[PlannedStage]) -> None:
        """Submit, in plan order, every stage whose dependencies allow it now."""
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
            try:
                done = act.handle.poll()
            except PipelineError as e:
                act.handle.cancel()
                self._end(act, e)
                continue
            act.watch.poll()
            if done:
                try:
                    act.handle.outcome()
                except PipelineError as e:
                    self._end(act, e)
                else:
                    self._end(act, None)

    def _end(self, act: _Active, error: PipelineError | None) -> None:
        self.active.remove(act)
        act.watch.progress.close()
        name = act.planned.name
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

    def interrupted(self, intr: Interrupted) -> None:
        """Cancel every job but a committer that runs beside a cancelled job (it commits what was staged and ends
        by itself once that job is gone); wait for it unless interrupted again; then report and re-raise."""
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
        self.say(f"interrupted in {where}; latest = {_latest_text(layout)}; resume: {resume_command(layout)}")


def _execute(
    plan: Plan, launcher: Launcher, say: Say, lease: RunLease, *, after_create: Callable[[], None] | None, t0: float
) -> None:
    ex = _Execution(plan, launcher, lease, say, after_create)
    todo: list[PlannedStage] = []
    for planned in plan.stages:
        if planned.runs:
            todo.append(planned)
        else:
            say(planned.describe())
            ex.status[planned.name] = "skipped"
    wait = not launcher.chains or bool(getattr(plan.cfg.launcher, "wait", True))
    try:
        ex.submit_ready(todo)
        if not wait:
            _submitted(plan, ex, say)
            return
        while todo or ex.active:
            ex.poll()
            ex.submit_ready(todo)
            if ex.active:
                time.sleep(plan.cfg.launcher.poll_interval_s)
    except Interrupted as intr:
        ex.interrupted(intr)
        raise
    _summarize(plan, ex.times, t0, say, failed=ex.failure is not None)
    if ex.failure is not None:
        raise ex.failure


def _submitted(plan: Plan, ex: _Execution, say: Say) -> None:
    """``launcher.wait=false`` on SLURM: the chain is in the scheduler's hands; say how to follow it."""
    ids = " ".join(h.job_id for h in ex.handles.values())
    if not ex.handles:
        say("nothing to submit: every stage is done" if ex.failure is None else "nothing was submitted")
    else:
        say(f"submitted {len(ex.handles)} job(s): {ids}")
        say(f"status:  python -m pipeline.status {plan.layout.run_dir}   (or: squeue -j {ids.replace(' ', ',')})")
    if ex.failure is not None:
        raise ex.failure


def _latest_text(layout: RunLayout) -> str:
    try:
        latest = read_latest(layout) if layout.latest.exists() else None
    except (VerificationError, OSError, ValueError) as e:
        return f"unreadable ({e})"
    return f"step {latest.step}" if latest else "none"


def _summarize(plan: Plan, times: dict[str, float], t0: float, say: Say, *, failed: bool) -> None:
    layout, cfg = plan.layout, plan.cfg
    if times:
        say("times: " + ", ".join(f"{n} {s:.1f}s" for n, s in times.items()) + f"; total {time.monotonic() - t0:.1f}s")
    latest = None
    with contextlib.suppress(VerificationError, OSError, ValueError):
        latest = read_latest(layout) if layout.latest.exists() else None
    if latest is None:
        say("no committed step yet")
    else:
        say(f"manifest: {layout.committed_step(latest.step) / 'manifest.json'}")
        say(f"latest:   {layout.latest} -> step {latest.step}")
        if layout.export_step(latest.step).exists():
            say(f"export:   {layout.export_step(latest.step)}")
    if failed:
        say(f"failed; latest = {_latest_text(layout)}; after fixing the cause, resume: {resume_command(layout)}")
    elif latest is not None and latest.step < cfg.train.steps and cfg.stage == STAGE_ALL and not cfg.import_.source:
        say(f"stopped at step {latest.step} of {cfg.train.steps}; resume: {resume_command(layout)}")


def status_lines(plan: Plan) -> list[str]:
    """The ``status=true`` view: who owns the run, each stage's last record and what a launch would do now."""
    layout = plan.layout
    lines = [f"run {layout.run_id}: {layout.run_dir}"]
    try:
        lease = read_lease(layout)
    except PipelineError as e:
        lease, lines = None, [*lines, f"lease: {e}"]
    if lease is not None:
        jobs = ", ".join(f"{j['stage']}={j['job_id']}" for j in lease.get("jobs", [])) or "none yet"
        lines.append(f"owner: pid {lease['pid']} on {lease['host']} since {lease['started']} (jobs: {jobs})")
    else:
        lines.append("owner: none (no launch is running)")
    for planned in plan.stages:
        rec = read_record(layout, planned.name) or {}
        last = f"{rec.get('status')} {rec.get('ended') or rec.get('started') or ''}".strip() if rec else "never ran"
        lines.append(f"  {planned.name:16} last: {last:32} next launch: {planned.describe().split(' ', 1)[0]}")
    lines.append(f"latest: {_latest_text(layout)}")
    return lines
