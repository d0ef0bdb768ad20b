"""kill -9 at random times: of a train rank, of a whole stage job, of the launcher itself.

Each trial copies the finished base run (steps 4 and 8 committed) and extends it to step 80, so a launch runs
train (steps 9..80, a checkpoint every 4), verify-manifest, consolidate and export; a SIGKILL lands at a
seeded random moment on the trial's target (rotating rank → job → launcher):

* **rank**: one task process of the train job, up to a few seconds after the ranks started;
* **job**: the whole process tree of one stage's job (a random stage among those that run; the local job id
  recorded in ``lease.json`` is the pid of the job's setup shell), shortly after it was submitted;
* **launcher**: only the launching process (it runs in a session of its own). Its jobs are orphaned: the next
  launch must refuse in one line naming the owner while they live, or break the stale lease once they are
  gone. The test then kills the orphans itself and recovers.

After each kill the run must hold its invariants (:func:`~tests.reliability.harness.check_run`), nothing of
the run may be left running once its launcher has ended, and a plain rerun (``python -m pipeline run.id=base
run.root=<root>``) must complete the run with its export: to step 80, or to step 8 where the launcher died
before it recorded ``train.steps=80`` in ``run.yaml``. The launcher never prints a traceback.

Figure: kills N, violations V, leftover processes P, failed recoveries F (target: V = P = F = 0; a kill whose
target ended before its random delay is a miss, and at most a third may miss).
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from pipeline.rundir.layout import RunLayout
from tests.reliability.conftest import record, sized
from tests.reliability.harness import (
    BASE_ID,
    BASE_STEPS,
    Launch,
    base_run,
    check_run,
    committed,
    job_tree,
    kill_leftovers,
    kill_tree,
    launch,
    launcher_faults,
    lease_jobs,
    leftovers,
    ranks_of,
    recorded_steps,
    run,
    seeded_rng,
    wait_for,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.distributed]

STEPS = 80
PG_TIMEOUT_S = 15
"""A rank killed before the rendezvous leaves the other waiting for its peer up to the process-group timeout."""
TARGETS = ("rank", "job", "launcher")
LATER_STAGES = ("train", "verify_manifest", "consolidate", "export")


@dataclass
class Trial:
    target: str
    landed: str | None = None
    """What was killed and when; None if the target was gone before the kill (not counted as a kill)."""
    violations: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    recovery_failed: str | None = None


def _job_of(layout: RunLayout, stage: str) -> str | None:
    return next((str(j["job_id"]) for j in lease_jobs(layout) if j.get("stage") == stage), None)


def _kill_rank(first: Launch, layout: RunLayout, rng: random.Random) -> str | None:
    job = wait_for("the train job", lambda: _job_of(layout, "train"), 180, while_alive=first)
    if job is None:
        return None
    ranks = wait_for("two train ranks", lambda: r if len(r := ranks_of(job)) == 2 else None, 60, while_alive=first)
    if ranks is None:
        return None
    # rendezvous, training, saves, exit: a rank forked by its controller (launchers.local_forks) has its imports
    # done and lives about 3 s on an idle 2-core machine for these 72 steps
    delay = rng.uniform(0.0, 1.2)
    time.sleep(delay)
    task = rng.randrange(2)
    try:
        ranks[task].send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        return None
    return f"task {task} (pid {ranks[task].pid}) of train job {job}, {delay:.2f}s after the ranks started"


def _kill_job(first: Launch, layout: RunLayout, rng: random.Random) -> str | None:
    stage = rng.choice(LATER_STAGES)
    job = wait_for(f"the {stage} job", lambda: _job_of(layout, stage), 240, while_alive=first)
    if job is None:
        return None
    delay = rng.uniform(0.0, 1.2)  # a consolidate or committer job can end 2 s after it was submitted
    time.sleep(delay)
    killed = kill_tree(int(job))
    if not killed:
        return None
    return f"{stage} job {job} ({len(killed)} processes), {delay:.2f}s after it was submitted"


def _kill_launcher(first: Launch, rng: random.Random) -> str | None:
    delay = rng.uniform(1.0, 20.0)
    time.sleep(max(0.0, first.started + delay - time.monotonic()))
    if not first.running():
        return None
    os.kill(first.pid, signal.SIGKILL)
    first.proc.wait(timeout=30)
    return f"the launcher (pid {first.pid}), {delay:.2f}s after it started"


def _next_launch_after_launcher_kill(trial: Trial, layout: RunLayout, root: Path, first: Launch, logs: Path) -> None:
    """While orphaned jobs live the next launch refuses in one line naming the owner; else it breaks the lease."""
    had_lease = layout.lease.exists()
    orphans_alive = any(job_tree(str(j["job_id"])) for j in lease_jobs(layout))
    second = launch(root, BASE_ID, logs=logs)
    rc = second.wait(300)
    trial.violations += launcher_faults(second, one_line_error=rc == 2)
    if rc == 2:
        err = second.stderr.strip()
        if "owned by another launch" not in err or f"pid {first.pid}" not in err:
            trial.violations.append(f"the launch after the kill refused without naming the owner: {err!r}")
        if not orphans_alive and not any(job_tree(str(j["job_id"])) for j in lease_jobs(layout)):
            trial.violations.append(f"refused although no job of the dead owner lives: {err!r}")
    elif rc == 0:
        if had_lease and "broke stale lease" not in second.stdout:
            trial.violations.append(f"the launch after the kill proceeded without breaking the lease:\n{second.output}")
    else:
        trial.violations.append(f"the launch after the kill exited {rc}:\n{second.output}")
    # the orphans may still run (their owner is dead): this test ends them, as an operator would
    kill_leftovers(layout.run_dir)


def _trial(i: int, target: str, rng: random.Random, tmp_path: Path) -> Trial:
    root, logs = tmp_path / f"t{i}", tmp_path / "console"
    layout = base_run(root, logs)
    before = committed(layout)
    trial = Trial(target)
    first = launch(root, BASE_ID, f"train.steps={STEPS}", f"strategy.pg_timeout_s={PG_TIMEOUT_S}", logs=logs)
    try:
        if target == "rank":
            trial.landed = _kill_rank(first, layout, rng)
        elif target == "job":
            trial.landed = _kill_job(first, layout, rng)
        else:
            trial.landed = _kill_launcher(first, rng)
        if target != "launcher":
            killed_at = time.monotonic()
            rc = first.wait(300)
            trial.landed = trial.landed and f"{trial.landed}; launch ended {time.monotonic() - killed_at:.0f}s later"
            trial.violations += launcher_faults(first, one_line_error=False)
            if rc not in (0, 1):
                trial.violations.append(f"the launch whose {target} was killed exited {rc}:\n{first.output}")
            trial.leftovers += leftovers(layout.run_dir)
        else:
            _next_launch_after_launcher_kill(trial, layout, root, first, logs)
    finally:
        if first.running():
            kill_tree(first.pid)
            first.proc.wait(timeout=30)
    trial.violations += check_run(layout, before)
    after_fault = committed(layout)
    final = recorded_steps(layout)  # the base's 8 if the launcher died before it recorded train.steps=80
    if final not in (BASE_STEPS, STEPS):
        trial.violations.append(f"run.yaml records train.steps={final}, neither {BASE_STEPS} nor {STEPS}")
    recovery = run(root, BASE_ID, logs=logs)
    faults = launcher_faults(recovery, one_line_error=False)
    if recovery.proc.returncode != 0 or faults:
        trial.recovery_failed = f"exit {recovery.proc.returncode} {faults}:\n{recovery.output}"
    trial.violations += check_run(layout, {**before, **after_fault}, final_step=final)
    trial.leftovers += leftovers(layout.run_dir)
    return trial


def test_kill9_at_random_times_keeps_committed_steps_and_recovers(tmp_path: Path) -> None:
    rng, seed = seeded_rng("kill9")
    trials = []
    t0 = time.monotonic()
    for i in range(int(os.environ.get("RELIABILITY_KILLS", sized(ci=2, large=50)))):
        trial = _trial(i, TARGETS[i % len(TARGETS)], rng, tmp_path)
        print(f"trial {i}: {trial.target}: {trial.landed or 'missed (target gone before the kill)'}")
        trials.append(trial)
    kills = sum(t.landed is not None for t in trials)
    violations = [v for t in trials for v in t.violations]
    left = [p for t in trials for p in t.leftovers]
    failed = [t.recovery_failed for t in trials if t.recovery_failed]
    figure = (
        f"kills {kills}, violations {len(violations)}, leftover processes {len(left)}, failed recoveries {len(failed)}"
    )
    enough = kills >= math.ceil(2 * len(trials) / 3)  # a kill misses when its target ended before the delay
    notes = [f"seed {seed}, {len(trials)} trials in {time.monotonic() - t0:.0f}s", *violations, *left, *failed]
    record("kill -9 (rank, job, launcher)", figure, ok=enough and not (violations or left or failed), notes=notes)
    assert not violations, "\n".join(violations)
    assert not left, f"processes of the run left over: {left}"
    assert not failed, "\n\n".join(failed)
    assert enough, f"only {kills} of {len(trials)} kills landed (seed {seed})"
