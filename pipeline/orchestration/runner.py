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
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Protocol

from pipeline.checkpoint.manifest import read_latest
from pipeline.config.identity import RunRecord, differences, read_run_record, write_run_record
from pipeline.config.overrides import DEFAULT_ROOT, carried
from pipeline.config.schema import STAGE_ALL, PipelineConfig
from pipeline.errors import ConfigError, PipelineError, RunNotFoundError, VerificationError
from pipeline.orchestration.contract import Resources, StageContract
from pipeline.orchestration.lease import RunLease, read_lease
from pipeline.orchestration.plan import Plan, PlannedStage, make_plan
from pipeline.orchestration.progress import StageProgress, commit_lines
from pipeline.orchestration.records import now_iso, read_record, sweep_record_litter, write_record
from pipeline.stages import get_stage
from pipeline.storage.atomic import write_bytes_atomic
from pipeline.storage.layout import RunLayout

if TYPE_CHECKING:
    from launchers.base import Launcher

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

    @staticmethod
    def of(planned: PlannedStage, plan: Plan) -> StageJob:
        return StageJob(
            planned.name, planned.contract, plan.cfg, plan.layout, planned.launch_id, planned.tasks, planned.resources
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


def resume_command(layout: RunLayout) -> str:
    cmd = f"python -m pipeline run.id={layout.run_id}"
    root = layout.run_dir.parent.parent
    if root != Path(DEFAULT_ROOT).resolve():
        cmd += f" run.root={shlex.quote(str(root))}"
    return cmd


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
        with RunLease.acquire(layout, command=[sys.executable, "-m", "pipeline", *sys.argv[1:]], say=say) as lease:
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
                    write_run_record(layout, cfg, new)

            if not cfg.run.overwrite:
                record_run()
            _execute(plan, launcher, say, lease, after_create=record_run if cfg.run.overwrite else None, t0=t0)
    return layout


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


def _launch(planned: PlannedStage, plan: Plan, launcher: Launcher, lease: RunLease, say: Say) -> float:
    t0 = time.monotonic()
    watch = _Watch(planned, plan, lease, say)
    try:
        launcher.run_stage(StageJob.of(planned, plan), watch)
        watch.poll()
    finally:
        watch.progress.close()
    return time.monotonic() - t0


def _execute(
    plan: Plan, launcher: Launcher, say: Say, lease: RunLease, *, after_create: Callable[[], None] | None, t0: float
) -> None:
    layout = plan.layout
    status: dict[str, str] = {}
    times: dict[str, float] = {}
    failure: PipelineError | None = None
    for planned in plan.stages:
        name = planned.name
        if not planned.runs:
            say(planned.describe())
            status[name] = "skipped"
            continue
        blocked = [n for n in planned.needs if status.get(n) != "succeeded"]
        if blocked and not planned.contract.after_any:
            say(f"skip {name}: {', '.join(blocked)} did not succeed")
            status[name] = "not run"
            continue
        say(planned.describe())
        try:
            times[name] = _launch(planned, plan, launcher, lease, say)
        except Interrupted as intr:
            _interrupted(plan, planned, launcher, lease, say, intr)
            raise
        except PipelineError as e:
            status[name] = "failed"
            say(f"FAIL {name}: {str(e).splitlines()[0]}")
            failure = failure or e
            continue
        status[name] = "succeeded"
        say(f"done {name} in {times[name]:.1f}s")
        if planned.contract.creates_run and after_create is not None:
            after_create()
        summary = (read_record(layout, name) or {}).get("summary")
        if isinstance(summary, dict) and "committed" in summary:
            for line in commit_lines(layout, summary):
                say(f"     {line}")
    _summarize(plan, times, t0, say, failed=failure is not None)
    if failure is not None:
        raise failure


def _interrupted(
    plan: Plan, planned: PlannedStage, launcher: Launcher, lease: RunLease, say: Say, intr: Interrupted
) -> None:
    """The launcher has cancelled the job and waited for its processes; commit what can be, then report."""
    layout = plan.layout
    say(f"INTERRUPTED {planned.name} by {intr}: its job was cancelled and its processes are gone")
    if layout.stages.is_dir():
        write_record(layout, planned.name, status="interrupted", signal=str(intr), ended=now_iso())
    for committer in plan.dependents_after_any(planned.name):
        say(f"run  {committer.name} (commits the steps staged before the interrupt; interrupt again to skip)")
        try:
            _launch(committer, plan, launcher, lease, say)
        except Interrupted:
            say(f"skip {committer.name}: interrupted again")
            break
        except PipelineError as e:  # expected: the step being saved at the interrupt is incomplete
            say(f"     {committer.name}: {str(e).splitlines()[0]}")
    say(f"interrupted in {planned.name}; latest = {_latest_text(layout)}; resume: {resume_command(layout)}")


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
    elif latest is not None and latest.step < cfg.train.steps and cfg.stage == STAGE_ALL:
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
