"""What the SLURM launcher would submit, read from the generated sbatch text (no cluster needed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import submitit

from launchers.resources import sbatch_lines, submitit_parameters
from launchers.submitit_launcher import RequeuedAtTimeLimit, SubmititLauncher, rendezvous_port, task_entry
from pipeline.config.compose import load_config
from pipeline.driver.plan import make_plan
from pipeline.driver.supervise import StageJob
from pipeline.errors import ConfigError
from pipeline.rundir.layout import RunLayout

needs_srun = pytest.mark.skipif(
    shutil.which("srun") is None, reason="submitit writes SLURM scripts only where srun is (scripts/slurm/start.sh)"
)


def _plan(tmp_path: Path, *overrides: str):  # noqa: ANN202
    cfg = load_config(
        ["+experiment=tiny", f"run.root={tmp_path}", "run.id=r", "launcher=slurm", "dry_run=true", *overrides]
    )
    return make_plan(cfg, RunLayout.for_run(tmp_path, "tiny", "r"))


def _lines(tmp_path: Path, stage: str, *overrides: str) -> list[str]:
    plan = _plan(tmp_path, *overrides)
    return sbatch_lines(next(s for s in plan.stages if s.name == stage), plan)


@needs_srun
def test_multi_node_train_spreads_tasks_evenly(tmp_path: Path) -> None:
    lines = _lines(tmp_path, "train", "strategy.world_size=8", "launcher.stages.train.nodes=2", "strategy.backend=nccl")
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks-per-node=4" in lines
    assert "#SBATCH --gpus-per-node=4" in lines  # one GPU per rank, asked per node; LOCAL_RANK picks it
    assert "#SBATCH --mem=16GB" in lines  # 4 GB per task, 4 tasks per node
    assert any(line.startswith("#SBATCH --signal=USR2@") for line in lines)


@needs_srun
def test_resources_per_stage_and_defaults(tmp_path: Path) -> None:
    lines = _lines(
        tmp_path,
        "consolidate",
        "launcher.partition=big",
        "launcher.account=proj",
        "launcher.qos=high",
        "launcher.stages.consolidate.time_min=7",
        "launcher.stages.consolidate.cpus_per_task=3",
        "launcher.stages.consolidate.constraint=ssd",
        "+launcher.stages.consolidate.extra.exclusive=user",
    )
    for want in (
        "--partition=big",
        "--account=proj",
        "--qos=high",
        "--time=7",
        "--cpus-per-task=3",
        "--constraint=ssd",
    ):
        assert f"#SBATCH {want}" in lines, lines
    assert "#SBATCH --exclusive=user" in lines
    assert "#SBATCH --kill-on-invalid-dep=yes" in lines  # a failed upstream job cancels it, never pends forever
    train = _lines(tmp_path, "train", "train.time_limit_min=90")
    assert "#SBATCH --time=90" in train and "#SBATCH --ntasks-per-node=2" in train


def test_uneven_nodes_and_local_multi_node_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="do not spread evenly over 3 nodes"):
        _plan(tmp_path, "launcher.stages.train.nodes=3")
    with pytest.raises(ConfigError, match="only train spans nodes"):
        _plan(tmp_path, "launcher.stages.export.nodes=2")
    cfg = load_config(["+experiment=tiny", f"run.root={tmp_path}", "launcher.stages.train.nodes=2"])
    with pytest.raises(ConfigError, match="needs launcher=slurm"):
        make_plan(cfg, RunLayout.for_run(tmp_path, "tiny", "r"))


def test_rendezvous_comes_from_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 2-node job the master is the job's first node and the port a function of the job id, the same for
    every task (what train's process group is built from)."""
    env = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_NTASKS_PER_NODE": "4",
    }
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    assert os.environ["MASTER_ADDR"] == "gpu07"
    assert os.environ["RANK"] == "5" and os.environ["WORLD_SIZE"] == "8" and os.environ["LOCAL_RANK"] == "1"
    port = os.environ["MASTER_PORT"]
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    assert os.environ["MASTER_PORT"] == port  # derived from the job id, not drawn per task


def test_rendezvous_port_is_the_jobs_and_below_the_ephemeral_range() -> None:
    """Every task derives the same port from the job id, below the kernel's ephemeral ports (where srun's and
    slurmstepd's listening sockets are: submitit's own 20000-60000 choice collided with one on the cluster)."""
    ports = {job: rendezvous_port(job) for job in ("31", "32", "4242", "123_4")}
    assert ports == {job: rendezvous_port(job) for job in ports}
    assert len(set(ports.values())) == len(ports)
    assert all(10000 <= p < 32768 for p in ports.values())


def test_a_local_jobs_port_is_free_on_the_machine() -> None:
    """A local job's port is chosen once by the launcher and skips a port a service already listens on (a
    derived port met SeaweedFS's master on 19333 in CI: EADDRINUSE at rank 0's rendezvous)."""
    import socket  # noqa: PLC0415

    from launchers import resources  # noqa: PLC0415

    first = resources.free_local_port(start=7)
    with socket.socket() as busy:
        busy.bind(("", first))
        busy.listen()
        picked = resources.free_local_port(start=7)
    assert picked != first and 10000 <= picked < 32768


def test_dry_run_without_srun_says_so_instead_of_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launchers import resources  # noqa: PLC0415

    monkeypatch.setattr(resources.shutil, "which", lambda _name: None)
    lines = _lines(tmp_path, "train")
    assert len(lines) == 1 and "submitit writes them only where srun is on PATH" in lines[0]


@pytest.mark.parametrize(("limit", "requeues"), [(2880, 3), (600, 10), (60, 0)])
def test_committer_asks_for_one_train_job_plus_its_last_pass(tmp_path: Path, limit: int, requeues: int) -> None:
    """Not train's limit times its requeues (8 days with the defaults: partitions refuse that, or it pends): the
    committer is requeued at its own limit as train is, and restarted by the launcher if it ends while train runs."""
    plan = _plan(tmp_path, f"train.time_limit_min={limit}", f"launcher.max_num_timeout={requeues}")
    committer = next(s for s in plan.stages if s.name == "verify_manifest")
    assert committer.resources.timeout_min == limit + 30
    params = submitit_parameters(committer.contract, 1, committer.resources, plan.cfg.launcher, "r", "after:7")
    assert params["timeout_min"] == limit + 30 and params["slurm_dependency"] == "after:7"


@needs_srun
def test_committer_sbatch_time_is_train_limit_plus_30_minutes(tmp_path: Path) -> None:
    assert "#SBATCH --time=2910" in _lines(tmp_path, "verify_manifest")
    assert "#SBATCH --time=630" in _lines(tmp_path, "verify_manifest", "train.time_limit_min=600")


def test_on_slurm_the_committer_is_requeued_at_its_time_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit requeues a job at its time limit only if its callable can checkpoint: the committer's can (the
    same call again, same job id, so the jobs queued after it keep waiting for it); train requeues itself."""
    submitted: dict[str, object] = {}

    class Executor:
        def submit(self, fn: object, stage: str, *args: object) -> SimpleNamespace:
            submitted[stage] = fn
            return SimpleNamespace(job_id="7", paths=SimpleNamespace(folder=tmp_path))

    monkeypatch.setattr(SubmititLauncher, "executor", lambda self, job, after=(): Executor())
    plan = _plan(tmp_path)
    slurm = SubmititLauncher(plan.cfg.launcher, cluster="slurm")
    for planned in plan.stages:
        slurm.submit(StageJob.of(planned, plan))
    committer = submitted.pop("verify_manifest")
    assert isinstance(committer, RequeuedAtTimeLimit)
    assert submitted and all(fn is task_entry for fn in submitted.values())
    call = ("verify_manifest", plan.cfg, "/run", "attempt-1", None)
    again = committer.checkpoint(*call)
    assert again.function is committer and again.args == call and not again.kwargs
    # locally it never outlives train's own limit (the launcher cancels train past it): a plain job
    local = SubmititLauncher(plan.cfg.launcher, cluster="local")
    local.submit(StageJob.of(next(s for s in plan.stages if s.name == "verify_manifest"), plan))
    assert submitted["verify_manifest"] is task_entry


def test_a_train_job_whose_node_failed_is_left_to_slurm_until_it_requeues_and_the_rerun_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Task 0's result (it failed: its peer's node was killed) while task 1 has none and SLURM still runs the job:
    SLURM may end it NODE_FAIL and requeue it, so the launcher waits (up to launcher.peer_grace_s); once SLURM
    requeued it, the first run's results are stale until the rerun writes its own (seen on the test cluster: the
    launcher reported FAIL while SLURM requeued train and it finished)."""
    from launchers import submitit_launcher as sl  # noqa: PLC0415
    from pipeline.config.launcher import SlurmLauncherConfig  # noqa: PLC0415
    from pipeline.stagekit.jobs import Requeue  # noqa: PLC0415

    results = [tmp_path / "0_result.pkl", tmp_path / "1_result.pkl"]
    task = [SimpleNamespace(paths=SimpleNamespace(result_pickle=p)) for p in results]
    sjob = SimpleNamespace(job_id="82", state="RUNNING", paths=SimpleNamespace(folder=tmp_path), done=results[0].exists)
    sjob.task = lambda t: task[t]  # type: ignore[attr-defined]
    job = SimpleNamespace(tasks=2, stage="train", resources=SimpleNamespace(timeout_min=60))
    handle = sl.SubmititHandle(SubmititLauncher(SlurmLauncherConfig(peer_grace_s=60.0), "slurm"), sjob, job)  # type: ignore[arg-type]
    state = {"82": "RUNNING"}
    monkeypatch.setattr(sl, "slurm_states", lambda ids: dict(state))
    monkeypatch.setattr(sl, "REQUEUE_POLL_S", 0.0)
    assert handle.poll() is False
    results[0].write_bytes(b"failed")  # rank 0 failed; rank 1 vanished with its node
    assert handle.poll() is False, "SLURM still runs the job: it may requeue it"
    monkeypatch.setattr(sl, "requeued", lambda _job: Requeue("82", 1, "NODE_FAIL", "node2", "node2", ""))
    monkeypatch.setattr(sl, "release_begin_time", lambda _job: False)
    assert handle.requeued() is not None
    state["82"] = "RUNNING"  # the rerun
    assert handle.poll() is False, "the results are the first run's"
    for p in results:
        p.write_bytes(b"ok")
        os.utime(p, (handle._run_since + 5, handle._run_since + 5))  # noqa: SLF001
    assert handle.poll() is True
    # a job whose task has no result and that SLURM no longer runs is judged at once (as before)
    other = sl.SubmititHandle(handle.launcher, sjob, job)  # type: ignore[arg-type]
    results[1].unlink()
    state["82"] = "FAILED"
    assert other.poll() is True


def test_a_one_task_committer_that_slurm_requeued_on_node_fail_is_not_judged_while_slurm_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The committer's node was cut off: submitit's view says the job ended (NODE_FAIL) with no result, while SLURM
    has already queued it again. Judged then, the launcher started a second committer beside the requeued one
    (seen on the test cluster: one of them was fenced out and the launch failed); it waits for SLURM's word."""
    from launchers import submitit_launcher as sl  # noqa: PLC0415
    from pipeline.config.launcher import SlurmLauncherConfig  # noqa: PLC0415

    result = tmp_path / "0_result.pkl"
    task = SimpleNamespace(paths=SimpleNamespace(result_pickle=result))
    sjob = SimpleNamespace(job_id="91", state="NODE_FAIL", paths=SimpleNamespace(folder=tmp_path), done=lambda: True)
    sjob.task = lambda t: task  # type: ignore[attr-defined]
    job = SimpleNamespace(tasks=1, stage="verify_manifest", resources=SimpleNamespace(timeout_min=60))
    handle = sl.SubmititHandle(SubmititLauncher(SlurmLauncherConfig(), "slurm"), sjob, job)  # type: ignore[arg-type]
    state = {"91": "PENDING"}
    monkeypatch.setattr(sl, "slurm_states", lambda ids: dict(state))
    monkeypatch.setattr(sl, "REQUEUE_POLL_S", 0.0)
    assert handle.poll() is False, "SLURM holds it (requeued): not ended"
    state["91"] = "NODE_FAIL"
    assert handle.poll() is True, "SLURM no longer holds it: judged"
    result.write_bytes(b"ok")
    os.utime(result, (handle._run_since + 5, handle._run_since + 5))  # noqa: SLF001
    state["91"] = "RUNNING"
    assert handle.poll() is True, "a result of this run: judged at once"
