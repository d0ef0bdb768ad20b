"""The committer beside train is started again when it ends while train runs (a kill -9, the OOM killer).

One end-to-end run (a real launch, the committer SIGKILLed mid-train), and the restart rules against a fake
launcher: which ends restart it and which are its verdict, the bound per launch, no restart while an interrupt
is handled, and on a chaining launcher (SLURM) the jobs queued after it are queued again after the new one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.config.compose import load_config
from pipeline.driver.plan import make_plan
from pipeline.driver.supervise import RESTARTS_PER_LAUNCH, Execution, Interrupted, StageJob
from pipeline.errors import StageFailedError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.records import write_record
from pipeline.storage.atomic import read_json
from tests.conftest import ROOT

# --- the restart rules, against a fake launcher -----------------------------------------------------------------


class _Job:
    """A fake job: ``poll`` says whether it ended; ``outcome`` raises ``error`` if it failed."""

    def __init__(self, n: int, job: StageJob, after: Sequence[tuple[str, _Job]]) -> None:
        self.job_id, self.stage, self.folder = str(n), job.stage, Path("/logs")
        self.after = [(kind, dep.job_id) for kind, dep in after]
        self.beside = job.beside
        self.ended, self.error, self.cancelled = False, None, False

    def end(self, error: str | None = None) -> None:
        self.ended, self.error = True, StageFailedError(error) if error else None

    def poll(self) -> bool:
        return self.ended

    def outcome(self) -> None:
        if self.error is not None:
            raise self.error

    def requeued(self) -> None:
        return None

    def cancel(self, wait: bool = True) -> None:
        self.cancelled = self.ended = True
        self.error = StageFailedError("cancelled")


class _Launcher:
    cluster = "fake"

    def __init__(self, chains: bool) -> None:
        self.chains = chains
        self.jobs: list[_Job] = []

    def submit(self, job: StageJob, after: Sequence[tuple[str, _Job]] = ()) -> _Job:
        self.jobs.append(_Job(100 + len(self.jobs), job, after))
        return self.jobs[-1]

    def live(self, stage: str) -> _Job:
        return next(j for j in reversed(self.jobs) if j.stage == stage)


class _Lease:
    def record_job(self, stage: str, job_id: str, cluster: str) -> None:
        pass


def _execution(tmp_path: Path, chains: bool) -> tuple[Execution, _Launcher, list[str]]:
    cfg = load_config(["+experiment=tiny", f"run.root={tmp_path}", "run.id=s", "launcher.poll_interval_s=0.01"])
    layout = RunLayout.for_run(tmp_path, "tiny", "s")
    plan = make_plan(cfg, layout)
    layout.stages.mkdir(parents=True)
    lines: list[str] = []
    launcher = _Launcher(chains)
    ex = Execution(plan, launcher, _Lease(), lines.append, None, todo=[s for s in plan.stages if s.runs])  # type: ignore[arg-type]
    return ex, launcher, lines


def _start_train(ex: Execution, launcher: _Launcher) -> None:
    """Submit what is ready, let prepare_dirs succeed: train and the committer beside it run."""
    ex.submit_ready()
    launcher.live("prepare_dirs").end()
    ex.poll()
    ex.submit_ready()
    train = next(s for s in ex.plan.stages if s.name == "train")
    write_record(ex.plan.layout, "train", status="running", attempt=train.launch_id)


def _committer_record(ex: Execution, job: _Job, status: str) -> None:
    write_record(ex.plan.layout, "verify_manifest", status=status, job_id=job.job_id, attempt="a")


def test_a_committer_killed_while_train_runs_is_started_again_beside_it(tmp_path: Path) -> None:
    ex, launcher, lines = _execution(tmp_path, chains=False)
    _start_train(ex, launcher)
    first = launcher.live("verify_manifest")
    _committer_record(ex, first, "running")  # killed: it never wrote how it ended
    first.end("stage verify_manifest failed (job 102): its task died without a result")
    ex.poll()

    second = launcher.live("verify_manifest")
    assert second is not first and second.beside == first.beside and second.beside is not None
    assert second.beside.job_id == launcher.live("train").job_id
    assert "verify_manifest" not in ex.status and not ex.failures
    said = "\n".join(lines)
    restarted = f"verify_manifest: starting it again (restart 1 of at most {RESTARTS_PER_LAUNCH} per launch): "
    assert f"{restarted}job {first.job_id} ended while train runs: stage verify_manifest failed" in said, said
    assert not any(j.stage == "consolidate" for j in launcher.jobs), "consolidate still waits for the committer"


def test_a_committer_that_ends_while_train_runs_is_restarted_at_most_the_bound(tmp_path: Path) -> None:
    ex, launcher, lines = _execution(tmp_path, chains=False)
    _start_train(ex, launcher)
    for _ in range(RESTARTS_PER_LAUNCH + 1):
        launcher.live("verify_manifest").end("killed")
        ex.poll()
    assert sum(j.stage == "verify_manifest" for j in launcher.jobs) == 1 + RESTARTS_PER_LAUNCH
    assert ex.status["verify_manifest"] == "failed"
    assert any("not started again" in line for line in lines) and "FAIL verify_manifest: killed" in lines


def test_a_committer_verdict_after_train_ended_stands(tmp_path: Path) -> None:
    """Once train's record has ended, a committer that failed with an error of its own (a quarantined step, an
    incomplete one) has given its verdict; a kill in its last pass (no record of its own) is started again."""
    ex, launcher, lines = _execution(tmp_path, chains=False)
    _start_train(ex, launcher)
    train = next(s for s in ex.plan.stages if s.name == "train")
    write_record(ex.plan.layout, "train", status="succeeded", attempt=train.launch_id)  # its job still ends

    killed = launcher.live("verify_manifest")
    _committer_record(ex, killed, "running")
    killed.end("its task died")
    ex.poll()
    assert launcher.live("verify_manifest") is not killed
    assert any("died in its last pass: its task died" in line for line in lines), lines

    verdict = launcher.live("verify_manifest")
    _committer_record(ex, verdict, "failed")
    verdict.end("VerificationError: step 12: rank 1 missing")
    ex.poll()
    assert launcher.live("verify_manifest") is verdict
    assert ex.status["verify_manifest"] == "failed" and "FAIL verify_manifest: VerificationError" in lines[-1]


def _requeued_committer_after_train(tmp_path: Path) -> tuple[Any, Any, list[str], Any]:
    """On SLURM: train has ended, and SLURM requeued the committer's job (restart 1) after its node2 was cut off."""
    from pipeline.stagekit.jobs import Requeue

    ex, launcher, lines = _execution(tmp_path, chains=True)
    _start_train(ex, launcher)
    train = next(s for s in ex.plan.stages if s.name == "train")
    write_record(ex.plan.layout, "train", status="succeeded", attempt=train.launch_id)
    job = launcher.live("verify_manifest")
    act = next(a for a in ex.active if a.handle is job)
    act.requeued = Requeue(job.job_id, 1, "NODE_FAIL", "node2", "node2", "")
    return ex, launcher, lines, job


def test_a_ghosts_failed_record_is_no_verdict_of_the_requeued_run(tmp_path: Path) -> None:
    """SLURM requeued the committer (its node cut off); the cut-off first run (a ghost, the same job id) writes
    ``failed`` once its node is back, and its end makes SLURM end the requeued run too. That record is the
    earlier run's, not the job's verdict: the committer is started again, also once train has ended."""
    ex, launcher, lines, job = _requeued_committer_after_train(tmp_path)
    layout = ex.plan.layout
    write_record(layout, "verify_manifest", status="running", job_id=job.job_id, attempt="a", restart=1)
    write_record(layout, "verify_manifest", status="failed", job_id=job.job_id, attempt="a", restart=0)  # the ghost
    assert read_json(layout.stage_record("verify_manifest"))["status"] == "running", "a later run's record is kept"
    ghost = {"status": "failed", "job_id": job.job_id, "restart": 0}  # landed anyway (the writer reads, then writes)
    layout.stage_record("verify_manifest").write_text(json.dumps(ghost))
    job.end("stage verify_manifest failed: its task died without a result or a Python error")
    ex.poll()
    assert launcher.live("verify_manifest") is not job, lines
    assert any("(a ghost) ended after its node came back" in line for line in lines), lines
    assert "verify_manifest" not in ex.status


def test_a_requeued_committer_that_recorded_success_succeeds_whatever_a_ghost_left_in_its_result_file(
    tmp_path: Path,
) -> None:
    """SLURM requeued the committer (its node cut off) and the requeued run finished and recorded ``succeeded``;
    the cut-off first run (a ghost of the same job id) ended later with an error, and its result file, the job's
    one, is what the launcher reads: the job succeeded (seen once in CI on 2ab0995, after train had ended: the
    launch failed with ``latest`` at its last step and consolidate already run on SLURM's ``afterok``)."""
    ex, launcher, lines, job = _requeued_committer_after_train(tmp_path)
    write_record(ex.plan.layout, "verify_manifest", status="succeeded", job_id=job.job_id, attempt="a", restart=1)
    job.end("stage verify_manifest failed: failed (no error text)")  # the ghost's result, written last
    ex.poll()
    assert launcher.live("verify_manifest") is job, "not started again: it succeeded"
    assert ex.status.get("verify_manifest") == "succeeded" and not ex.failures, lines
    assert any("(a ghost)" in line and "recorded its success" in line for line in lines), lines
    assert not any(line.startswith("FAIL") for line in lines), lines


def test_no_restart_while_an_interrupt_is_handled(tmp_path: Path) -> None:
    ex, launcher, lines = _execution(tmp_path, chains=False)
    _start_train(ex, launcher)
    committer = launcher.live("verify_manifest")
    committer.end("its task died")  # dies while the launcher waits for its last pass
    ex.interrupted(Interrupted(signal.SIGINT))
    assert launcher.live("verify_manifest") is committer and launcher.live("train").cancelled
    assert not any("starting it again" in line for line in lines), lines


def test_on_slurm_the_jobs_queued_after_the_committer_are_queued_again_after_the_new_one(tmp_path: Path) -> None:
    ex, launcher, lines = _execution(tmp_path, chains=True)
    _start_train(ex, launcher)
    old = {s: launcher.live(s) for s in ("train", "verify_manifest", "consolidate", "export")}
    assert ("afterok", old["verify_manifest"].job_id) in old["consolidate"].after
    old["verify_manifest"].end("CANCELLED by the OOM killer")
    old["consolidate"].end("cancelled before it started: a job it depends on did not succeed")  # kill_invalid_depend
    ex.poll()
    ex.submit_ready()

    new = {s: launcher.live(s) for s in ("verify_manifest", "consolidate", "export")}
    assert all(new[s] is not old[s] for s in new)
    assert new["verify_manifest"].after == [("after", old["train"].job_id)]
    assert ("afterok", new["verify_manifest"].job_id) in new["consolidate"].after
    assert old["verify_manifest"].job_id not in {job for _, job in new["consolidate"].after}
    assert new["export"].after == [("afterok", new["consolidate"].job_id)]
    assert old["export"].cancelled, "the old export, queued on the old chain, is cancelled"
    assert not ex.failures and not any(line.startswith("FAIL") for line in lines), lines
    assert {a.planned.name for a in ex.active} == {"train", "verify_manifest", "consolidate", "export"}


# --- end to end: kill -9 of the committer job while train runs ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_committer_killed_mid_train_is_replaced_and_latest_reaches_the_final_step(tmp_path: Path) -> None:
    layout = RunLayout.for_run(tmp_path, "tiny", "k")
    args = ["+experiment=tiny", f"run.root={tmp_path}", "run.id=k", "run.create=true", "train.steps=40"]
    args += [
        "checkpoint.every=4",
        "launcher.poll_interval_s=0.2",
        "strategy.world_size=1",
        "export=none",
    ]  # the committer is the point
    # every save takes a second, so train is still running when the committer is killed and when it is back
    env = {**os.environ, "PIPELINE_FAULTS": "shard_save.before_marker@action=sleep@seconds=1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        victim = _committer_after_its_first_commit(layout, proc)
        killed_at = read_latest(layout).step  # type: ignore[union-attr]
        victim.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

    assert proc.returncode == 0, out + err
    record = read_json(layout.stage_record("verify_manifest"))
    assert "verify_manifest: starting it again (restart 1 of at most" in out and "ended while train runs" in out, out
    assert record["pid"] != victim.pid and record["status"] == "succeeded"
    later = [s for s in record["summary"]["committed"] if s > killed_at]
    assert 40 in later and len(later) >= 2, f"the new committer committed {record['summary']['committed']}:\n{out}"
    assert killed_at < 40, "the kill landed after train's last step: the test proved nothing"
    latest = read_latest(layout)
    assert latest is not None and latest.step == 40
    verify_committed(layout.committed_step(40), 40)
    assert (layout.consolidated_step(40) / "model.safetensors").is_file(), out  # the stages after train ran
    leftovers = [p.pid for p in psutil.process_iter() if _names(p, layout)]
    assert not leftovers, f"processes of the run outlived the launcher: {leftovers}"


def _committer_after_its_first_commit(layout: RunLayout, proc: subprocess.Popen[str]) -> psutil.Process:
    """The committer's task process, once ``latest`` exists (it has committed a step while train runs)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early: {proc.communicate()}")
        try:
            record = read_json(layout.stage_record("verify_manifest"))
            if record.get("status") == "running" and read_latest(layout) is not None:
                victim = psutil.Process(int(record["pid"]))
                if "submitit" in " ".join(victim.cmdline()):
                    return victim
        except (OSError, ValueError, psutil.Error):
            pass
        time.sleep(0.1)
    raise AssertionError("the committer committed nothing in time")


def _names(proc: psutil.Process, layout: RunLayout) -> bool:
    try:
        return str(layout.run_dir) in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
