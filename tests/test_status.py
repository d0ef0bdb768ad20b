"""``python -m pipeline.status``: the read-only view of a run, built on run dirs made without training.

Steps are staged with the seed helpers (what shard-save writes, minus DCP) and committed by the real
verify-manifest task, so manifests, ``latest`` and quarantine notes are the pipeline's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tests.seed_helpers as sh
from pipeline import status
from pipeline.checkpoint.protocol import retention
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.config.compose import load_config
from pipeline.config.identity import write_run_record
from pipeline.config.schema import CheckpointConfig, PipelineConfig
from pipeline.driver.lease import RunLease
from pipeline.driver.run_status import resume_command
from pipeline.driver.task import execute_task
from pipeline.errors import VerificationError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit import jobs
from pipeline.stagekit.records import now_iso, write_record
from tests.conftest import ROOT
from tests.test_structure import NOT_IN_TOOLS

ATTEMPT = "train-statustest"
T0, T1 = "2026-01-02T03:04:05Z", "2026-01-02T03:04:09Z"


@pytest.fixture
def run(tmp_path: Path) -> tuple[PipelineConfig, RunLayout]:
    """A run dir as prepare-dirs leaves it (without assets) plus its run.yaml; nothing ran yet."""
    cfg = load_config(
        ["+experiment=tiny", f"run.root={tmp_path / 'outputs'}", "run.id=r1", "checkpoint.marker_deadline_s=1"]
    )
    layout = RunLayout.for_run(cfg.run.root, cfg.experiment, "r1")
    for d in layout.planned_dirs():
        d.mkdir(parents=True, exist_ok=True)
    layout.logs.mkdir(mode=0o700)
    write_run_record(layout, cfg, ["+experiment=tiny"])
    return cfg, layout


def _stage_step(layout: RunLayout, step: int) -> set[str]:
    return {f for r in range(2) for f in sh.stage_rank(layout, step, r, world=2, attempt=ATTEMPT)}


def _commit(cfg: PipelineConfig, layout: RunLayout) -> None:
    execute_task("verify_manifest", cfg, str(layout.run_dir), "verify_manifest-statustest")


def _record(layout: RunLayout, stage: str, state: str, job_id: str, started: str = T0, **extra: object) -> None:
    ended = {} if state == "running" else {"ended": T1, "seconds": 4.0}
    attempt = f"{stage}-statustest"
    write_record(layout, stage, status=state, attempt=attempt, job_id=job_id, started=started, **ended, **extra)


def _status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what building the run printed (the committer's log lines)
    code = status.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], layout: RunLayout) -> dict[str, Any]:
    code, out, err = _status(capsys, str(layout.run_dir), "--json")
    assert (code, err) == (0, "")
    parsed = json.loads(out)
    assert isinstance(parsed, dict)
    return parsed


def _finish(cfg: PipelineConfig, layout: RunLayout) -> None:
    """A finished run: steps 4 and 8 committed, every stage succeeded, step 8 consolidated and exported."""
    _record(layout, "prepare_dirs", "succeeded", "6079")
    _stage_step(layout, 4)
    _stage_step(layout, 8)
    _record(layout, "train", "succeeded", "6106")
    _commit(cfg, layout)
    _record(layout, "consolidate", "succeeded", "6200")
    _record(layout, "export", "succeeded", "6300")
    for area, marker in ((layout.consolidated, "consolidated.json"), (layout.export, "provenance.json")):
        (area / "step_8").mkdir()
        (area / "step_8" / marker).write_text("{}")


def _line(out: str, start: str) -> str:
    found = _lines(out, start, 1)
    return found[0]


def _lines(out: str, start: str, n: int) -> list[str]:
    found = [ln for ln in out.splitlines() if ln.strip().startswith(start)]
    assert len(found) == n, (start, out)
    return found


def test_finished_run(run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]) -> None:
    cfg, layout = run
    _finish(cfg, layout)
    code, out, err = _status(capsys, str(layout.run_dir))
    print(out, file=sys.stderr)  # shown with -s / on failure: what a user sees
    assert (code, err) == (0, "")
    assert _line(out, "run:").split() == ["run:", "r1"]
    assert _line(out, "experiment:").split() == ["experiment:", "tiny"]
    assert "owner:      none (no launch is running)" in out
    for stage in ("prepare_dirs", "train", "verify_manifest", "consolidate", "export"):
        assert _line(out, stage + " ").split()[1] == "succeeded", out
    assert "6106" in _line(out, "train") and T0 in _line(out, "train") and "4.0s" in _line(out, "train")
    assert "errors:" not in out
    assert _line(out, "latest:").split() == ["latest:", "step", "8"]
    assert _line(out, "step 4").split()[:3] == ["step", "4", "3"]
    assert _line(out, "step 8").split()[-1] == "latest" and "latest" not in _line(out, "step 4")
    assert "staged:" not in out and "quarantined:" not in out
    assert _line(out, "consolidated:").split() == ["consolidated:", "step", "8"]
    assert _line(out, "exported:").split() == ["exported:", "step", "8"]
    assert _line(out, "resume:").split(None, 1)[1] == resume_command(layout)

    data = _json(capsys, layout)
    committed = data["checkpoints"]["committed"]
    size = sum(len(sh.shard_bytes(8, r, f"__{r}_0.distcp")) for r in range(2)) + len(sh.shard_bytes(8, 0, ".metadata"))
    assert committed == [
        {"step": 4, "latest": False, "files": 3, "bytes": size, "format": sh.TEST_FORMAT, "world_size": 2},
        {"step": 8, "latest": True, "files": 3, "bytes": size, "format": sh.TEST_FORMAT, "world_size": 2},
    ]


def test_resume_command_is_the_runners(run: tuple[PipelineConfig, RunLayout]) -> None:
    from pipeline.driver.runner import resume_command as runners

    _, layout = run
    assert resume_command(layout) == runners(layout)
    assert "run.root=" in resume_command(layout)  # tmp_path is not the default root


def test_failed_run_names_the_error_and_its_logs(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, layout = run
    _record(layout, "prepare_dirs", "succeeded", "6079")
    _stage_step(layout, 4)
    _record(layout, "train", "failed", "4242", error="RuntimeError: boom on rank 1\nTraceback: second line")
    _commit(cfg, layout)
    logs = layout.logs / "train" / "4242"
    logs.mkdir(parents=True)
    for rank in (0, 1):
        (logs / f"4242_{rank}_log.err").write_text("...")
        (logs / f"4242_{rank}_log.out").write_text("...")
    code, out, err = _status(capsys, str(layout.run_dir))
    assert (code, err) == (0, "")
    assert _line(out, "train ").split()[1] == "failed"
    assert _line(out, "consolidate ").split()[1:] == ["never", "ran"]
    assert "train: failed: RuntimeError: boom on rank 1" in out
    assert "second line" not in out
    assert _line(out, "logs:").split(None, 1)[1] == f"{logs}/ (4242_0_log.err, 4242_1_log.err)"
    assert _line(out, "latest:").split() == ["latest:", "step", "4"]

    stage = {s["stage"]: s for s in _json(capsys, layout)["stages"]}["train"]
    assert stage["error"] == "RuntimeError: boom on rank 1"
    assert stage["log_dir"] == str(logs) and stage["log_files"] == ["4242_0_log.err", "4242_1_log.err"]


def test_running_stage_with_a_live_pid_is_running(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]
) -> None:
    _, layout = run
    _record(layout, "prepare_dirs", "succeeded", "6079")
    _record(layout, "train", "running", str(os.getpid()), started=now_iso(), pid=os.getpid())
    sh.stage_rank(layout, 4, 0, world=2, attempt=ATTEMPT)
    code, out, _ = _status(capsys, str(layout.run_dir))
    assert code == 0
    assert _line(out, "train").split()[1] == "running"
    assert _line(out, "train").endswith("s so far")
    assert "errors:" not in out
    assert _line(out, "staged:") == "  staged: step 4: 1 of 2 rank markers"
    assert _line(out, "latest:").split() == ["latest:", "none"]


def test_running_stage_with_a_dead_pid_died(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]
) -> None:
    _, layout = run
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _record(layout, "train", "running", str(gone.pid), pid=gone.pid)
    code, out, _ = _status(capsys, str(layout.run_dir))
    assert code == 0
    assert _line(out, "train ").split()[1:4] == ["died", "(pid", f"{gone.pid}"]
    assert f"train: died (pid {gone.pid} gone): (no error recorded)" in out
    assert _line(out, "logs:").split(None, 1)[1] == f"{layout.logs / 'train' / str(gone.pid)}/ (no *_log.err files)"
    assert {s["stage"]: s["state"] for s in _json(capsys, layout)["stages"]}["train"] == "died"


def test_slurm_jobs_show_the_schedulers_state(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, layout = run
    asked: list[list[str]] = []

    def fake_states(job_ids: list[str]) -> dict[str, str]:
        asked.append(sorted(set(job_ids)))
        return {"5001": "CANCELLED", "5002": "RUNNING", "5000": "COMPLETED"}

    monkeypatch.setattr(jobs, "slurm_states", fake_states)
    _record(layout, "prepare_dirs", "succeeded", "5000")
    _record(layout, "train", "running", "5001")  # this host and a live pid: only the scheduler knows it died
    _record(layout, "verify_manifest", "running", "5002")
    with RunLease.acquire(layout, command=["python", "-m", "pipeline"], say=lambda _: None) as lease:
        for stage, job_id in (("prepare_dirs", "5000"), ("train", "5001"), ("verify_manifest", "5002")):
            lease.record_job(stage, job_id, "slurm")
        code, out, _ = _status(capsys, str(layout.run_dir))
        data = _json(capsys, layout)
    assert code == 0
    assert asked and asked[0] == ["5000", "5001", "5002"]
    assert "succeeded (SLURM: COMPLETED)" in _line(out, "prepare_dirs")
    assert "died (SLURM: CANCELLED)" in _line(out, "train ")
    assert "running (SLURM: RUNNING)" in _line(out, "verify_manifest")
    assert "train: died (SLURM: CANCELLED)" in out
    assert f"owner:      pid {os.getpid()}" in out and "(alive)" in out
    assert "train 5001 (slurm: CANCELLED)" in _line(out, "jobs:")
    stages = {s["stage"]: s for s in data["stages"]}
    assert stages["train"]["state"] == "died" and stages["train"]["slurm_state"] == "CANCELLED"
    assert data["owner"]["jobs"][1] == {
        "stage": "train",
        "job_id": "5001",
        "cluster": "slurm",
        "host": stages["train"]["host"],
        "state": "CANCELLED",
    }


def _handed_over_slurm_lease(layout: RunLayout, job_ids: list[str]) -> None:
    """The lease a SLURM launch (``launcher.wait=false``) leaves: its jobs recorded, handed over to them, and the
    launching process gone."""
    lease = RunLease.acquire(layout, command=["python", "-m", "pipeline"], say=lambda _: None)
    for stage, job_id in zip(("prepare_dirs", "train", "verify_manifest"), job_ids, strict=False):
        lease.record_job(stage, job_id, "slurm")
    lease.hand_over()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    record = json.loads(layout.lease.read_text())
    layout.lease.write_text(json.dumps({**record, "pid": gone.pid}))


@pytest.mark.parametrize(
    ("states", "state", "says"),
    [
        ({}, "ended", "its jobs have all ended: nobody owns the run, the next launch takes it"),
        ({"5002": "RUNNING"}, "jobs", "its jobs hold the run until they end"),
    ],
)
def test_a_finished_slurm_launch_is_not_a_stale_lease(
    run: tuple[PipelineConfig, RunLayout],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    states: dict[str, str],
    state: str,
    says: str,
) -> None:
    """A SLURM launch exits once its chain is submitted and leaves the lease to its jobs: after a normal finish
    the lease is still there with its pid gone, which is no stale lease."""
    _, layout = run
    monkeypatch.setattr(jobs, "slurm_states", lambda ids: {j: states.get(j, "COMPLETED") for j in ids})
    _handed_over_slurm_lease(layout, ["5000", "5001", "5002"])
    code, out, _ = _status(capsys, str(layout.run_dir))
    assert code == 0
    owner = _line(out, "owner:")
    assert "stale" not in owner and says in owner and "exited 20" in owner, owner
    assert _json(capsys, layout)["owner"]["state"] == state


def test_a_launch_that_died_leaves_a_stale_lease(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]
) -> None:
    _, layout = run
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with RunLease.acquire(layout, command=["python", "-m", "pipeline"], say=lambda _: None):
        record = json.loads(layout.lease.read_text())
    layout.lease.write_text(json.dumps({**record, "pid": gone.pid}))
    code, out, _ = _status(capsys, str(layout.run_dir))
    assert code == 0 and f"pid {gone.pid}" in _line(out, "owner:") and "(not running: a stale lease)" in out
    assert _json(capsys, layout)["owner"]["state"] == "stale"


def test_quarantined_steps_show_their_reasons(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, layout = run
    _stage_step(layout, 4)
    _commit(cfg, layout)
    _stage_step(layout, 8)
    (layout.staged_step(8) / "__1_0.distcp").write_bytes(b"bit rot" * 100)  # after its marker: the size differs
    layout.checkpoints.joinpath("step_12").symlink_to(layout.committed_step(4))  # planted: never followed
    with pytest.raises(VerificationError):
        _commit(cfg, layout)
    code, out, _ = _status(capsys, str(layout.run_dir))
    assert code == 0
    quarantined = [ln for ln in out.splitlines() if ln.startswith("  quarantined:")]
    assert len(quarantined) == 2, out
    damaged = next(ln for ln in quarantined if "step_8." in ln)
    assert "(step 8, " in damaged and "step_8/__1_0.distcp: size 700 != 8192 recorded in" in damaged
    planted = next(ln for ln in quarantined if "step_12." in ln)
    assert "not a step directory" in planted
    assert _line(out, "latest:").split() == ["latest:", "step", "4"]
    entries = _json(capsys, layout)["checkpoints"]["quarantined"]
    assert sorted(str(e["step"]) for e in entries) == ["8", "None"]
    assert all(e["reason"] and e["time"] for e in entries)


def test_run_id_lookup(run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]) -> None:
    _, layout = run
    root = str(layout.run_dir.parent.parent)
    for args in (["r1"], ["r1", "--experiment", "tiny"], ["last"]):
        code, out, err = _status(capsys, *args, "--root", root)
        assert (code, err) == (0, ""), args
        assert _line(out, "dir:").split() == ["dir:", str(layout.run_dir)]

    other = layout.run_dir.parent.parent / "other" / "r1"
    other.mkdir(parents=True)
    (other / "run.yaml").write_bytes(layout.run_yaml.read_bytes())
    code, out, err = _status(capsys, "r1", "--root", root)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "several experiments (other, tiny)" in err
    code, out, _ = _status(capsys, "r1", "--root", root, "--experiment", "other")
    assert code == 0 and _line(out, "dir:").split() == ["dir:", str(other)]


@pytest.mark.parametrize("args", [["nope"], ["r1", "--experiment", "nope"], ["some/dir"], ["r1", "--bogus"]])
def test_bad_arguments_exit_2(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    _, layout = run
    code, out, err = _status(capsys, *args, "--root", str(layout.run_dir.parent.parent))
    assert (code, out) == (2, "")
    if "--bogus" not in args:  # argparse's own error comes with its usage line
        assert err.count("\n") == 1 and err.startswith("error: "), err
    if args == ["nope"]:
        assert "no run 'nope'" in err and "newest: r1" in err


def test_damaged_files_are_lines_not_tracebacks(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, layout = run
    _finish(cfg, layout)
    layout.stage_record("train").write_text("{not json")
    layout.latest.unlink()
    layout.latest.write_text("garbage")
    layout.lease.write_text("[]")
    (layout.committed_step(4) / "manifest.json").write_text("{}")
    (layout.checkpoints / "retention.json").write_text("{oops")
    code, out, err = _status(capsys, str(layout.run_dir))
    assert (code, err) == (0, "")
    assert "unreadable" in _line(out, "train ")
    assert "train: unreadable: stage record" in out and "not valid JSON" in out
    assert "latest: latest pointer" in out and "not valid JSON" in _line(out, "latest:")
    assert "lease" in _line(out, "owner:") and "malformed" in _line(out, "owner:")
    assert "damaged: malformed manifest" in _line(out, "step 4")
    assert _line(out, "retention:").startswith("  retention: unreadable: retention record")
    assert _json(capsys, layout)["checkpoints"]["latest"] is None


def test_retention_decisions_are_shown(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, layout = run
    _finish(cfg, layout)
    retention.apply(
        PosixCheckpoints(layout), CheckpointConfig(keep_last=1), latest_step=8
    )  # the record the committer writes
    code, out, _ = _status(capsys, str(layout.run_dir))
    assert code == 0
    assert _line(out, "retention").startswith("  retention at 20") and _line(out, "retention").endswith(
        "(latest step 8):"
    )
    assert _line(out, "policy:") == "    policy: keep_last=1"
    assert _lines(out, "checkpoints:", 2)[1] == "    checkpoints: kept step 8 (latest, newest 1); removed step 4"
    assert _line(out, "committed").split() == ["committed", "files", "size", "shared", "format"]
    assert "step 4" not in _line(out, "step 8") and [ln for ln in out.splitlines() if "step 4  " in ln] == []
    assert _json(capsys, layout)["checkpoints"]["retention"] == retention.read_record(layout)


def test_retention_record_of_another_shape_is_shown_as_it_is(
    run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]
) -> None:
    _, layout = run
    record = {"time": T1, "kept": {"8": "latest", "4": ["every 4 steps"]}, "removed": [2], "note": "by hand"}
    retention.record_path(layout).write_text(json.dumps(record))
    code, out, _ = _status(capsys, str(layout.run_dir))
    assert code == 0
    assert _line(out, "retention") == f"  retention at {T1}:"
    assert _line(out, "kept") == "    kept step 8 (latest), step 4 (every 4 steps); removed step 2"
    assert _line(out, "note:") == "    note: by hand"


def test_json_has_every_section(run: tuple[PipelineConfig, RunLayout], capsys: pytest.CaptureFixture[str]) -> None:
    cfg, layout = run
    _finish(cfg, layout)
    data = _json(capsys, layout)
    assert set(data) >= {
        "run_id",
        "run_dir",
        "experiment",
        "owner",
        "stages",
        "checkpoints",
        "consolidated",
        "exported",
        "resume",
    }
    assert (data["run_id"], data["experiment"], data["owner"]) == ("r1", "tiny", None)
    assert [s["stage"] for s in data["stages"]] == [
        "prepare_dirs",
        "train",
        "verify_manifest",
        "consolidate",
        "export",
    ]
    assert set(data["checkpoints"]) >= {"latest", "committed", "staged", "quarantined", "retention"}
    assert data["checkpoints"]["latest"]["step"] == 8
    assert data["consolidated"] == data["exported"] == [{"step": 8, "complete": True}]


def test_help_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.status", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m pipeline.status") and "--json" in out.stdout


def test_status_of_a_run_and_of_a_library_dir_loads_no_hydra_or_app_module(
    run: tuple[PipelineConfig, RunLayout],
) -> None:
    """Showing a finished app run (its run.yaml, stage records, lease, checkpoints) and a library checkpoint dir
    loads no Hydra, OmegaConf, submitit, config schema, stage module or runner: status reads runs as data."""
    cfg, layout = run
    _finish(cfg, layout)
    library = layout.run_dir.parent / "library"
    (library / "checkpoints").mkdir(parents=True)
    code = (
        "import runpy, sys\n"
        f"for target in ({str(layout.run_dir)!r}, {str(library)!r}):\n"
        "    sys.argv = ['pipeline.status', target]\n"
        "    try:\n"
        "        runpy.run_module('pipeline.status', run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        f"print(sorted(m for m in sys.modules if m.startswith({NOT_IN_TOOLS!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert "latest: step 8" in out.stdout and "run the training script again" in out.stdout, out.stdout
    assert out.stdout.splitlines()[-1] == "[]", out.stdout.splitlines()[-1]


def test_the_fast_tier_line_says_where_the_replicas_are() -> None:
    from pipeline.driver.status_view import _resume_lines  # noqa: PLC0415

    fast = {"every": 2, "dir": "/dev/shm/x", "replicas": 1, "keep": 2}
    one_node = _resume_lines({"fast": {**fast, "same_node": True}, "tier": "none", "attempt": "a"}, None)[0]
    assert "1 replica(s) on this node (one node: they do not survive its loss)" in one_node
    nodes = _resume_lines({"fast": {**fast, "same_node": False}, "tier": "none", "attempt": "a"}, None)[0]
    assert "1 replica(s) on other nodes" in nodes
