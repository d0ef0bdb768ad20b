"""The runner: owns a run for one launch (lease), fixes the run once, and executes the plan.

Order of a launch: decide the run dir and id → take the run's lease → check the run's identity against
``run.yaml`` → record the launch (``run.yaml``, ``.hydra/``) → compute the plan → run its stages one job at a
time → print a summary. Ctrl-C, SIGTERM and SIGHUP cancel the running job, wait (bounded) until its processes
are gone, still run the committer so complete staged steps are committed, record the stage as ``interrupted``
and end with the command that resumes the run. How the jobs are driven (and the committer restarted) is
:mod:`pipeline.driver.supervise`.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType

import pipeline.stagekit.checkpoint_store as storage
from pipeline.config.identity import RunRecord, differences, read_run_record, recorded_changes, write_run_record
from pipeline.config.launcher import SlurmLauncherConfig
from pipeline.config.overrides import carried
from pipeline.config.schema import STAGE_ALL, PipelineConfig
from pipeline.driver.lease import RunLease
from pipeline.driver.plan import Plan, make_plan
from pipeline.driver.run_status import collect
from pipeline.driver.status_view import render
from pipeline.driver.supervise import (
    Execution,
    Interrupted,
    JobLauncher,
    JobWatch,
    Say,
    StageJob,
    latest_text,
)
from pipeline.errors import ConfigError, PipelineError, RunNotFoundError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.jobs import ACTIVE_STATES, job_alive, slurm_states
from pipeline.stagekit.records import resume_command, sweep_record_litter
from pipeline.stages import get_stage
from pipeline.storage.atomic import write_bytes_atomic

__all__ = [  # StageJob, JobWatch and Interrupted live in supervise; launchers, the CLI and tests find them here too
    "Interrupted",
    "JobWatch",
    "StageJob",
    "check_identity",
    "new_run_id",
    "resolve_layout",
    "run",
    "status_lines",
]

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
    launcher: JobLauncher,
    say: Say = print,
    *,
    overrides: list[str] | None = None,
    hydra_files: dict[str, str] | None = None,
    planned: Plan | None = None,
) -> RunLayout:
    """Launch the pipeline for ``cfg`` (raises the first failure, or :class:`Interrupted`). ``planned``: the plan
    the launch's checks made (the CLI's), used when nothing changed in the run since: one plan per launch."""
    layout = resolve_layout(cfg)
    if cfg.run.id is None:
        cfg.run.id = layout.run_id  # decided once, here (the CLI decides it before, in its checks)
    t0 = time.monotonic()
    with interrupts_raise():
        layout.run_dir.mkdir(parents=True, exist_ok=True)
        layout.logs.mkdir(parents=True, exist_ok=True, mode=0o700)  # owner: this process; job folders hold pickles
        command = [sys.executable, "-m", "pipeline", *sys.argv[1:]]
        with RunLease.acquire(layout, command=command, say=say, job_state=job_alive) as lease:
            record = check_identity(cfg, layout)
            holds = planned is not None and planned.layout == layout and planned.still_holds()
            sweep_record_litter(layout)  # we hold the lease: no task of this run is alive to be writing
            plan = planned if holds and planned is not None else make_plan(cfg, layout)
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
    # A job that just ended shows COMPLETING for a moment, or no state at all: gone from squeue, not yet in
    # sacct (slurmdbd writes accounting a little later, more so under load). Both are asked again, up to 15 s;
    # a job that is plainly queued or running owns the run at once.
    deadline = time.monotonic() + 15
    while True:
        ids = [j["job_id"] for j in lease.record["jobs"] if j["cluster"] == "slurm"]
        states = slurm_states(ids)
        live = [j for j in ids if states.get(j) is None or states[j] in ACTIVE_STATES]
        settling = all(states.get(j) in (None, "COMPLETING") for j in live)
        if not live or not settling or time.monotonic() > deadline:
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


def _execute(
    plan: Plan, launcher: JobLauncher, say: Say, lease: RunLease, *, after_create: Callable[[], None] | None, t0: float
) -> None:
    ex = Execution(plan, launcher, lease, say, after_create, todo=[s for s in plan.stages if s.runs])
    for planned in plan.stages:
        if not planned.runs:
            say(planned.describe())
            ex.status[planned.name] = "skipped"
    slurm = plan.cfg.launcher if isinstance(plan.cfg.launcher, SlurmLauncherConfig) else None
    wait = not launcher.chains or slurm is None or slurm.wait
    try:
        ex.submit_ready()
        if not wait:
            _submitted(plan, ex, say)
            return
        while ex.todo or ex.active:
            ex.poll()
            ex.submit_ready()
            if ex.active:
                time.sleep(plan.cfg.launcher.poll_interval_s)
    except Interrupted as intr:
        ex.interrupted(intr)
        raise
    _summarize(plan, ex.times, t0, say, failed=ex.failure is not None)
    if ex.failure is not None:
        raise ex.failure


def _submitted(plan: Plan, ex: Execution, say: Say) -> None:
    """``launcher.wait=false`` on SLURM: the chain is in the scheduler's hands; say how to follow it."""
    ids = " ".join(h.job_id for h in ex.handles.values())
    if not ex.handles:
        say("nothing to submit: every stage is done" if ex.failure is None else "nothing was submitted")
    else:
        say(f"submitted {len(ex.handles)} job(s): {ids}")
        say(f"status:  python -m pipeline.status {plan.layout.run_dir}   (or: squeue -j {ids.replace(' ', ',')})")
    if ex.failure is not None:
        raise ex.failure


def _summarize(plan: Plan, times: dict[str, float], t0: float, say: Say, *, failed: bool) -> None:
    layout, cfg = plan.layout, plan.cfg
    if times:
        say("times: " + ", ".join(f"{n} {s:.1f}s" for n, s in times.items()) + f"; total {time.monotonic() - t0:.1f}s")
    latest = None
    store = storage.store(cfg, layout)
    with contextlib.suppress(PipelineError, OSError, ValueError):
        latest = store.read_latest()
    if latest is None:
        say("no committed step yet")
    else:
        say(f"manifest: {store.manifest_where(latest.step)}")
        say(f"latest:   {store.latest_where()} -> step {latest.step}")
        if layout.export_step(latest.step).exists():
            say(f"export:   {layout.export_step(latest.step)}")
    if failed:
        say(f"failed; latest = {latest_text(layout, cfg)}; after fixing the cause, resume: {resume_command(layout)}")
    elif latest is not None and latest.step < cfg.train.steps and cfg.stage == STAGE_ALL and not cfg.import_.source:
        say(f"stopped at step {latest.step} of {cfg.train.steps}; resume: {resume_command(layout)}")


def status_lines(plan: Plan) -> list[str]:
    """The ``status=true`` view: ``python -m pipeline.status``'s (one view of a run), plus what a launch would
    do now (the plan, computed once for this launch)."""
    lines = render(collect(plan.layout))
    lines.append("next launch:")
    lines += [f"  {planned.describe()}" for planned in plan.stages]
    return lines
