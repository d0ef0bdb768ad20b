"""The pipeline on the real single-node SLURM cluster (``scripts/slurm/start.sh``), submitted through submitit.

Each test launches ``python -m pipeline ... launcher=slurm`` as a user would and reads the run dir and
``sacct`` afterwards. Sized for 2 cores: the tiny model, a few minutes in all (the requeue test is the long one).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import boto3
import pytest

from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.checkpoint.protocol import trash
from pipeline.checkpoint.stores.remote import Remote
from pipeline.rundir.layout import RunLayout
from pipeline.storage.s3 import S3Url
from tests.conftest import run_cli
from tests.slurm.conftest import SlurmCluster, settled_states, wait_for_jobs

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.xdist_group("slurm")]  # one cluster

FAST = ("launcher.poll_interval_s=0.3",)


def _launch(
    root: Path, run_id: str, *extra: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "+experiment=tiny",
        f"run.root={root}",
        f"run.id={run_id}",
        "run.create=true",
        "launcher=slurm",
        *FAST,
        *extra,
        env=env,
        timeout=timeout,
    )


def _job_ids(out: str) -> list[str]:
    m = re.search(r"submitted \d+ job\(s\): ([\d ]+)", out)
    assert m, out
    return m.group(1).split()


def _record(layout: RunLayout, stage: str) -> dict:
    return json.loads(layout.stage_record(stage).read_text())


def _manifest_hashes(layout: RunLayout, step: int) -> dict[str, str]:
    return {f.path: f.hash for f in read_manifest(layout.committed_step(step)).files}


def _steps_trained(layout: RunLayout) -> list[int]:
    lines = [json.loads(line) for line in layout.metrics.read_text().splitlines() if line.strip()]
    return [e["step"] for e in lines if e.get("event") == "step"]


def test_chain_submits_and_matches_a_local_run(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The whole chain is submitted at once (job ids printed, exit 0); every job completes; the committed steps
    equal a local run's with the same seed, file by file; a second launch submits nothing."""
    proc = _launch(tmp_path, "s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "status:  python -m pipeline.status" in proc.stdout
    ids = _job_ids(proc.stdout)
    assert len(ids) == 5, proc.stdout
    wait_for_jobs(ids, timeout_s=300)
    assert set(settled_states(ids, "COMPLETED").values()) == {"COMPLETED"}
    slurm = RunLayout.for_run(tmp_path, "tiny", "s")
    assert read_latest(slurm).step == 8  # type: ignore[union-attr]
    assert (slurm.export_step(8) / "config.json").is_file()
    assert _record(slurm, "train")["world_size"] == 2

    local = run_cli("+experiment=tiny", f"run.root={tmp_path}", "run.id=l", "run.create=true", *FAST, "export=none")
    assert local.returncode == 0, local.stdout + local.stderr
    local_layout = RunLayout.for_run(tmp_path, "tiny", "l")
    for step in (4, 8):
        assert _manifest_hashes(slurm, step) == _manifest_hashes(local_layout, step)

    again = _launch(tmp_path, "s")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to submit: every stage is done" in again.stdout
    # the finished chain held the run until its jobs ended; the next launch takes it over (no stale lease)
    assert "took the run over from launch" in again.stdout and "stale" not in again.stdout

    status = subprocess.run(
        [*_python(), "-m", "pipeline.status", str(slurm.run_dir), "--json"], capture_output=True, text=True, check=False
    )
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)  # the status of a finished SLURM run parses


def _python() -> list[str]:
    import sys  # noqa: PLC0415

    return [sys.executable]


def test_latest_advances_while_train_runs(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The committer runs beside train: steps are committed before train's job has ended."""
    proc = _launch(
        tmp_path,
        "adv",
        "train.steps=400",
        "checkpoint.every=50",
        "launcher.wait=true",
        "checkpoint.keep_last=3",
        "export=none",  # what is checked is the commits while train runs, not the outputs
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    layout = RunLayout.for_run(tmp_path, "tiny", "adv")
    committed_at = {int(k): v for k, v in _record(layout, "verify_manifest")["summary"]["committed_at"].items()}
    train_end = _iso_time(_record(layout, "train")["ended"])
    early = [s for s, t in committed_at.items() if t < train_end]
    assert early and min(early) == 50, (committed_at, train_end)
    # retention kept the newest 3; latest is the last step
    assert sorted(int(p.name[5:]) for p in layout.checkpoints.glob("step_*")) == [300, 350, 400]


def _iso_time(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone + 1  # the second's end


def test_double_submission_has_one_owner(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """While a submitted chain's jobs are queued or running, another launch of that run is refused in one line."""
    first = _launch(tmp_path, "d", "train.steps=200", "export=none")  # the ownership is checked, not the outputs
    assert first.returncode == 0, first.stdout + first.stderr
    ids = _job_ids(first.stdout)
    second = _launch(tmp_path, "d", "train.steps=200", "export=none")
    assert second.returncode != 0
    assert (
        second.stderr.count("\n") == 1
        and "may still be queued or running" in second.stderr
        and "owned by another launch: pid" in second.stderr
        and "scancel" in second.stderr
    ), second.stderr
    assert all(i in second.stderr for i in ids)
    wait_for_jobs(ids, timeout_s=300)
    assert set(settled_states(ids, "COMPLETED").values()) == {"COMPLETED"}


def test_dry_run_submits_nothing(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    proc = _launch(tmp_path, "dry", "dry_run=true", "launcher.stages.train.mem_gb=3")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --dependency='afterok:<prepare_dirs job>'" in proc.stdout
    assert "#SBATCH --dependency='after:<train job>'" in proc.stdout
    assert "#SBATCH --mem=6GB" in proc.stdout  # 3 GB per task, 2 tasks on the node
    assert "writes: checkpoints/staging/step_N/" in proc.stdout and "(about " in proc.stdout
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout == before
    assert not (tmp_path / "tiny" / "dry").exists()

    refused = _launch(tmp_path, "bad", "launcher.partition=nosuchpartition", "launcher.wait=true")
    assert refused.returncode == 1 and "sbatch refused stage prepare_dirs" in refused.stdout, refused.stdout
    assert "Traceback" not in refused.stdout + refused.stderr


def test_failed_stage_cancels_dependents_and_a_rerun_finishes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The committer dies before publishing step 8: SLURM cancels consolidate and export at once (they never
    pend); a plain rerun commits the staged step 8 without training again, then consolidates and exports."""
    proc = _launch(tmp_path, "f", env={"PIPELINE_FAULTS": "verify.before_publish@step=8@action=exit"})
    ids = _job_ids(proc.stdout)
    wait_for_jobs(ids, timeout_s=300)
    ends = ["COMPLETED", "COMPLETED", "FAILED", "CANCELLED", "CANCELLED"]
    states = settled_states(ids, dict(zip(ids, ends, strict=True)))
    assert [states[i] for i in ids] == ends, states
    layout = RunLayout.for_run(tmp_path, "tiny", "f")
    assert read_latest(layout).step == 4  # type: ignore[union-attr]
    status = subprocess.run(
        [*_python(), "-m", "pipeline.status", str(layout.run_dir)], capture_output=True, text=True, check=False
    )
    assert "CANCELLED" in status.stdout and "FAILED" in status.stdout, status.stdout

    rerun = _launch(tmp_path, "f", "launcher.wait=true")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "skip train: step 8 is staged with every rank's marker" in rerun.stdout
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    assert _steps_trained(layout) == list(range(1, 9))  # nothing trained twice

    one = _launch(tmp_path, "f", "stage=consolidate", "force=true", "launcher.wait=true")
    assert one.returncode == 0, one.stdout + one.stderr
    assert "run  consolidate" in one.stdout and "run  export" not in one.stdout and "run  train" not in one.stdout


def test_time_limit_requeues_and_resumes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A 2-minute train job that cannot finish: on SLURM's USR2 every rank saves the same step and the job
    requeues itself; after the requeue train resumes from exactly that step (committed meanwhile by the
    committer beside it); the second signal finds no requeue left (max_num_timeout=1): train saves and stops
    with a one-line reason. No step is lost or trained twice."""
    proc = _launch(
        tmp_path,
        "rq",
        "train.steps=1000000",
        "checkpoint.every=1000",
        "train.time_limit_min=2",
        "launcher.max_num_timeout=1",
        "launcher.signal_delay_s=60",
        "launcher.wait=true",
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "allows no more" in out, out
    layout = RunLayout.for_run(tmp_path, "tiny", "rq")
    events = [json.loads(line) for line in layout.metrics.read_text().splitlines() if line.strip()]
    starts = [e for e in events if e["event"] == "start"]
    ends = [e for e in events if e["event"] == "end"]
    assert len(starts) == 2 and len(ends) == 2, starts
    first_stop = ends[0]["last_step"]
    assert starts[1]["resume_from"] == first_stop > 0  # resumed from the step saved on the signal
    trained = _steps_trained(layout)
    assert trained == list(range(1, ends[1]["last_step"] + 1)), "every step once, in order"
    assert read_latest(layout).step == ends[1]["last_step"]  # type: ignore[union-attr]
    train_job = _record(layout, "train")["job_id"]
    assert settled_states([train_job], "FAILED")[train_job] == "FAILED"


def test_scancel_of_train_then_rerun_resumes_from_latest(
    slurm_cluster: SlurmCluster, tmp_path: Path, s3_env: dict[str, str], bucket: str, prefix: str
) -> None:
    """With checkpoints in a bucket (SeaweedFS on loopback; the jobs get the AWS variables from the submitting
    environment): scancel train mid-run; the committer commits what was complete and ends; a rerun resumes from
    the bucket's newest committed step, and no incomplete multipart upload is left behind."""
    storage = f"checkpoint.storage=s3://{bucket}/{prefix}"
    proc = _launch(tmp_path, "sc", "train.steps=1000000", "checkpoint.every=200", storage, "export=none", env=s3_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = _job_ids(proc.stdout)
    layout = RunLayout.for_run(tmp_path, "tiny", "sc")
    remote = Remote(root=S3Url(bucket, prefix).join("tiny", "sc"), cache_dir=layout.run_dir)

    def latest_step() -> int:
        latest, _ = remote.read_latest()
        return latest.step if latest else 0

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if latest_step() >= 400:
            break
        time.sleep(1)
    else:
        pytest.fail("latest never reached step 400 while train ran")
    running = _status_json(layout)  # the status of a running run
    train = next(st for st in running["stages"] if st["stage"] == "train")
    assert train["state"] == "running" and train["slurm_state"] == "RUNNING", train
    assert running["checkpoints"]["store"] == str(remote.root)
    subprocess.run(["scancel", ids[1]], check=True)
    wait_for_jobs(ids, timeout_s=120)
    after = next(st for st in _status_json(layout)["stages"] if st["stage"] == "train")
    assert after["slurm_state"] == "CANCELLED" and after["state"] != "running", after
    states = settled_states(ids, {ids[1]: "CANCELLED", ids[2]: ("COMPLETED", "FAILED")})
    assert states[ids[1]] == "CANCELLED" and states[ids[2]] in ("COMPLETED", "FAILED"), states
    committed = latest_step()
    assert committed >= 400

    rerun = _launch(
        tmp_path,
        "sc",
        f"train.stop_after_step={committed + 200}",
        "launcher.wait=true",
        storage,
        "export=none",
        env=s3_env,
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert _record(layout, "train")["summary"]["resumed_from"] == committed
    assert latest_step() == committed + 200
    assert not boto3.client("s3").list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")


def test_retention_survives_a_crash_midway(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The committer dies between moving a step aside and deleting it: every kept step is intact, consolidate
    and export are cancelled; the rerun finishes the deletion and the chain."""
    keep = ("train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=1")
    proc = _launch(tmp_path, "ret", *keep, env={"PIPELINE_FAULTS": "retention.before_delete@action=exit"})
    ids = _job_ids(proc.stdout)
    wait_for_jobs(ids, timeout_s=300)
    states = settled_states(ids, dict(zip(ids[2:], ["FAILED", "CANCELLED", "CANCELLED"], strict=True)))
    assert [states[i] for i in ids[2:]] == ["FAILED", "CANCELLED", "CANCELLED"], states
    layout = RunLayout.for_run(tmp_path, "tiny", "ret")
    latest = read_latest(layout)
    assert latest is not None and (layout.committed_step(latest.step) / "manifest.json").is_file()
    assert list((layout.checkpoints / ".deleting").iterdir()), "the crash left the moved step in the trash"

    rerun = _launch(tmp_path, "ret", *keep, "launcher.wait=true")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert sorted(p.name for p in layout.checkpoints.glob("step_*")) == ["step_8"]
    # what the crashed committer (an older epoch) moved stays restorable for trash.GRACE_S, then goes
    left = [p.name for p in (layout.checkpoints / ".deleting").iterdir()]
    assert all(trash.parse_entry(n) is not None for n in left), left
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    assert (layout.export_step(8) / "config.json").is_file()


def _status_json(layout: RunLayout) -> dict:
    proc = subprocess.run(
        [*_python(), "-m", "pipeline.status", str(layout.run_dir), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_ctrl_c_with_wait_cancels_the_chain_and_commits(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """``launcher.wait=true``, Ctrl-C mid-train: train and the queued jobs after it are cancelled, the committer
    commits what was staged and ends by itself, nothing of the run is left in the queue, the lease is released."""
    args = ["+experiment=tiny", f"run.root={tmp_path}", "run.id=int", "run.create=true", "launcher=slurm", *FAST]
    args += ["launcher.wait=true", "train.steps=1000000", "checkpoint.every=200"]
    proc = subprocess.Popen(
        [*_python(), "-m", "pipeline", *args],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    layout = RunLayout.for_run(tmp_path, "tiny", "int")
    deadline = time.monotonic() + 240
    while not (layout.latest.exists() and read_latest(layout).step >= 200):  # type: ignore[union-attr]
        assert time.monotonic() < deadline and proc.poll() is None, "latest never reached step 200"
        time.sleep(1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, out + err
    assert "INTERRUPTED train" in out and "verify_manifest commits the steps staged before the interrupt" in out, out
    jobs = dict(re.findall(r"^\s+(\w+): job (\d+),", out, flags=re.MULTILINE))
    ends: dict[str, str | tuple[str, ...]] = {"train": "CANCELLED", "verify_manifest": ("COMPLETED", "FAILED")}
    ends |= {"consolidate": "CANCELLED", "export": "CANCELLED"}
    states = settled_states(jobs.values(), {jobs[stage]: end for stage, end in ends.items()})
    assert states[jobs["train"]] == "CANCELLED" and states[jobs["verify_manifest"]] in ("COMPLETED", "FAILED"), states
    assert states[jobs["consolidate"]] == states[jobs["export"]] == "CANCELLED", states
    wait_for_jobs(jobs.values(), timeout_s=60)
    latest = read_latest(layout)
    assert latest is not None and latest.step >= 200
    assert f"latest = step {latest.step}" in out
    assert not layout.lease.exists(), "no job of the run is left: the lease is released"
