"""The seed reports' race patterns (see shared/seeds/README.md), reproduced, and the pipeline's answer to each.

For every seed there is an ``unguarded`` test that runs the reported pattern with truly concurrent processes
(started together at a barrier) and asserts that it FAILS the way the report says, so these tests would
catch the race coming back; next to it, a ``pipeline`` test runs the same scenario through the pipeline's
own code path and asserts that it succeeds.

* 002 ``--overwrite`` => every rank ``rmtree`` + ``makedirs``      vs. one prepare-dirs task, then rank-private mkdirs
* 000 every rank ``copytree`` into one shared dir                 vs. rank-private paths + one committer (verify)
* 001 every rank computes its own timestamped dir                 vs. run dir fixed once by the launching process
* 004 waits without a deadline or liveness check hang forever     vs. verify's bounded wait naming the missing rank
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from launchers.base import JobHandle, Launcher
from pipeline.checkpoint.manifest import MANIFEST, read_latest, read_manifest, read_marker
from pipeline.config.compose import load_config
from pipeline.config.schema import PipelineConfig
from pipeline.driver.runner import StageJob, resolve_layout
from pipeline.driver.runner import run as run_pipeline
from pipeline.driver.task import execute_task
from pipeline.errors import VerificationError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.records import read_record, write_record
from pipeline.stages import verify_manifest
from pipeline.storage.atomic import read_json
from tests import seed_helpers as sh
from tests.conftest import RunFactory

WORLD = 4  # more ranks than cores (2 in CI): the scheduler interleaves them as on a busy node
TRAIN_ATTEMPT = "train-seedtest"


def _config(root: Path, *overrides: str) -> PipelineConfig:
    return load_config(["+experiment=tiny", f"run.root={root}", "checkpoint.marker_deadline_s=1", *overrides])


def _verify(cfg: PipelineConfig, layout: RunLayout, attempt: str = "verify-test") -> dict[str, object]:
    return execute_task("verify_manifest", cfg, str(layout.run_dir), attempt)


def _start_train_record(layout: RunLayout, pid: int | None = None) -> None:
    """The train job's record, as its task 0 writes it: ``running`` with a pid (this process: alive)."""
    write_record(layout, "train", status="running", attempt=TRAIN_ATTEMPT, pid=pid if pid is not None else os.getpid())


def _assert_committed(layout: RunLayout, step: int, expected_files: set[str]) -> None:
    latest = read_latest(layout)
    assert latest is not None and latest.step == step
    step_dir = layout.committed_step(step)
    manifest = read_manifest(step_dir)
    assert {f.path for f in manifest.files} == expected_files
    for f in manifest.files:
        assert (step_dir / f.path).stat().st_size == f.size
    assert not layout.staged_step(step).exists(), "the staged step is published by one rename"


def _failures(results: list[sh.RankResult]) -> list[sh.RankResult]:
    return [r for r in results if not r.ok]


def _describe(results: list[sh.RankResult]) -> str:
    return "; ".join(f"rank {r.rank}: {r.error_type or 'ok'} {r.error or ''}".strip() for r in results)


# --- seed 002: destructive set-up on every rank -----------------------------------------------------------------


def _fill_old_checkpoint(ckpt_dir: Path, n_files: int = 60) -> None:
    for i in range(n_files):
        sub = ckpt_dir / f"step_{i % 6}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"old_{i}.bin").write_bytes(b"old" * 32)


@pytest.mark.distributed
def test_seed002_unguarded_overwrite_on_every_rank_fails(tmp_path: Path) -> None:
    """Every rank ``rmtree``s and recreates the checkpoint dir: losers die (FileNotFoundError / FileExistsError)."""
    ckpt_dir = tmp_path / "checkpoints"
    errors: list[sh.RankResult] = []
    rounds = 0
    while rounds < 20 and len(errors) < 3:  # one round almost always suffices; a few rounds make it certain
        rounds += 1
        _fill_old_checkpoint(ckpt_dir)
        errors += _failures(sh.run_ranks(sh.unguarded_overwrite, WORLD, ckpt_dir=str(ckpt_dir)))
    assert errors, f"the rmtree/makedirs race was not observed in {rounds} rounds of {WORLD} ranks"
    assert {e.error_type for e in errors} <= {"FileNotFoundError", "FileExistsError", "OSError"}, _describe(errors)


@pytest.mark.distributed
def test_seed002_pipeline_one_owner_deletes_then_ranks_mkdir(make_run: RunFactory) -> None:
    """``run.overwrite=true``: only prepare-dirs deletes, and it finishes before the ranks start; ranks only mkdir."""
    cfg, layout = make_run(f"strategy.world_size={WORLD}")
    # An old run's content under the same id: staged and committed steps, latest, a stale marker.
    _fill_old_checkpoint(layout.staging)
    old_committed = layout.committed_step(4)
    old_committed.mkdir()
    (old_committed / "old.bin").write_bytes(b"old")
    layout.latest.write_text('{"step": 4}')
    (layout.staging / "step_8").mkdir()
    (layout.staging / "step_8" / "rank_1.done.json").write_text("{}")

    cfg.run.overwrite = True
    for round_ in range(3):
        execute_task("prepare_dirs", cfg, str(layout.run_dir), f"prepare-dirs-overwrite-{round_}")
        assert sorted(p.name for p in layout.checkpoints.iterdir()) == ["quarantine", "staging"]
        assert list(layout.staging.iterdir()) == [], "the old run's content is gone"
        assert not layout.latest.exists()

        results = sh.run_ranks(
            sh.pipeline_stage_after_prepare, WORLD, run_dir=str(layout.run_dir), step=8, attempt=TRAIN_ATTEMPT
        )
        assert not _failures(results), _describe(results)
        staged = layout.staged_step(8)
        for rank in range(WORLD):
            assert (staged / f"rank_{rank}" / "shard.bin").read_bytes() == sh.shard_bytes(
                8, rank, f"rank_{rank}/shard.bin"
            )
            marker = read_marker(staged, rank)
            assert marker is not None and marker.attempt == TRAIN_ATTEMPT

    cfg.run.overwrite = False
    _verify(cfg, layout)
    _assert_committed(layout, 8, {f"rank_{r}/shard.bin" for r in range(WORLD)})


# --- seed 000: every rank copies into one shared destination ----------------------------------------------------


@pytest.mark.distributed
def test_seed000_unguarded_copytree_into_shared_dir_fails(tmp_path: Path) -> None:
    """All ranks ``copytree`` their offload dir into one ``offloaded_tensors``: all but one get FileExistsError."""
    shared = tmp_path / "checkpoint" / "offloaded_tensors"
    results = sh.run_ranks(
        sh.unguarded_copytree_shared, WORLD, offload_root=str(tmp_path / "offload"), shared_dst=str(shared)
    )
    failures = _failures(results)
    assert failures, "no rank lost the copytree race"
    assert {f.error_type for f in failures} == {"FileExistsError"}, _describe(results)
    assert len(failures) == WORLD - 1, _describe(results)
    # The one winner's tensors are there; every loser's tensors are lost.
    winner = next(r for r in results if r.ok)
    assert sorted(p.name for p in shared.iterdir()) == sorted(winner.value)


@pytest.mark.distributed
def test_seed000_pipeline_rank_private_paths_and_one_committer(tmp_path: Path, make_run: RunFactory) -> None:
    """Each rank writes only its own path of the staged step (+ marker); verify alone publishes the step."""
    cfg, layout = make_run(f"strategy.world_size={WORLD}")
    _start_train_record(layout)
    results = sh.run_ranks(
        sh.pipeline_copy_into_own_path,
        WORLD,
        offload_root=str(tmp_path / "offload"),
        run_dir=str(layout.run_dir),
        step=4,
        attempt=TRAIN_ATTEMPT,
    )
    assert not _failures(results), _describe(results)
    assert not layout.committed_step(4).exists() and read_latest(layout) is None, "no rank publishes anything"

    summary = _verify(cfg, layout)
    assert {k: summary[k] for k in ("committed", "latest")} == {"committed": [4], "latest": 4}
    expected = {rel for r in results for rel in r.value}
    assert len(expected) == WORLD * 4
    _assert_committed(layout, 4, expected)
    for r in results:
        for rel in r.value:
            assert (layout.committed_step(4) / rel).read_bytes() == sh.shard_bytes(0, r.rank, Path(rel).name)


# --- seed 001: every rank derives its own output dir ------------------------------------------------------------


STAGGER_S = 0.55  # rank 2 saves >1.1 s after rank 0: a per-second timestamp always differs between them


@pytest.mark.distributed
def test_seed001_unguarded_per_rank_timestamped_dir_fails(tmp_path: Path) -> None:
    """Each rank stamps its own output dir: shards scatter and rank 0 cannot find the others' (FileNotFoundError)."""
    base = tmp_path / "tmp-unimodel"
    results = sh.run_ranks(sh.unguarded_timestamped_save, 3, base=str(base), stagger_s=STAGGER_S)
    assert results[0].error_type == "FileNotFoundError", _describe(results)
    assert ".distcp" in (results[0].error or "")
    assert len(list(base.iterdir())) >= 2, "the ranks' shards landed in different directories"


@pytest.mark.distributed
def test_seed001_pipeline_run_dir_decided_once(tmp_path: Path) -> None:
    """The launching process resolves the run dir once (fresh run id) and hands it to every rank."""
    cfg = _config(tmp_path / "outputs", "strategy.world_size=3")
    assert cfg.run.id is None
    layout = resolve_layout(cfg)  # once, in the launching process (runner.run does exactly this)
    cfg.run.id = layout.run_id
    execute_task("prepare_dirs", cfg, str(layout.run_dir), "prepare-dirs-test")
    _start_train_record(layout)

    results = sh.run_ranks(
        sh.pipeline_given_run_dir_save,
        3,
        run_dir=str(layout.run_dir),
        step=4,
        attempt=TRAIN_ATTEMPT,
        stagger_s=STAGGER_S,
    )
    assert not _failures(results), _describe(results)
    assert {r.value["staged"] for r in results} == {str(layout.staged_step(4))}
    assert results[0].value["found"] == {
        f"__{r}_0.distcp": len(sh.shard_bytes(4, r, f"__{r}_0.distcp")) for r in range(3)
    }
    assert [p.name for p in (tmp_path / "outputs" / "tiny").iterdir()] == [layout.run_id], "one run dir only"

    _verify(cfg, layout)
    _assert_committed(layout, 4, {f"__{r}_0.distcp" for r in range(3)} | {".metadata"})


def test_seed001_layout_has_no_rank_clock_or_pid_input(tmp_path: Path) -> None:
    """Paths are pure functions of (root, experiment, run id): equal inputs give equal paths, at any time."""
    assert list(inspect.signature(RunLayout.for_run).parameters) == ["root", "experiment", "run_id"]
    a = RunLayout.for_run(tmp_path, "tiny", "r1")
    time.sleep(1.05)  # across a second boundary: a clock-derived path would change here
    b = RunLayout.for_run(str(tmp_path), "tiny", "r1")
    assert a == b
    assert [a.staged_step(4), a.committed_step(4), a.latest] == [b.staged_step(4), b.committed_step(4), b.latest]
    for path in (a.staged_step(4), a.committed_step(4), a.quarantine, a.export_step(4), a.consolidated_step(4)):
        assert str(os.getpid()) not in str(path.relative_to(tmp_path))

    cfg = _config(tmp_path, "run.id=r1")
    assert resolve_layout(cfg) == resolve_layout(cfg) == a
    # Without run.id a fresh id is drawn on every call: that is why only the launching process may call it.
    fresh = _config(tmp_path)
    assert resolve_layout(fresh) != resolve_layout(fresh)


class _Ran:
    def __init__(self, n: int) -> None:
        self.job_id, self.folder = str(n), Path("/unused")

    def poll(self) -> bool:
        return True

    def outcome(self) -> None:
        pass

    def requeued(self) -> None:
        return None

    def cancel(self, wait: bool = True) -> None:
        pass


class _RecordingLauncher(Launcher):
    cluster = "inprocess"

    def __init__(self) -> None:
        self.jobs: list[StageJob] = []

    def submit(self, job: StageJob, after: Sequence[tuple[str, JobHandle]] = ()) -> JobHandle:
        self.jobs.append(job)
        time.sleep(0.3)  # stage jobs start at different times; their run dir must not depend on it
        return _Ran(len(self.jobs))


def test_seed001_runner_fixes_run_id_before_any_stage(tmp_path: Path) -> None:
    """``runner.run`` without ``run.id``: the id is chosen once and every stage job gets the same run dir."""
    cfg = _config(tmp_path / "outputs")
    launcher = _RecordingLauncher()
    layout = run_pipeline(cfg, launcher, say=lambda _msg: None)
    assert cfg.run.id == layout.run_id
    assert [j.stage for j in launcher.jobs] == ["prepare_dirs", "train", "verify_manifest", "consolidate", "export"]
    assert {j.layout.run_dir for j in launcher.jobs} == {layout.run_dir}
    assert {j.cfg.run.id for j in launcher.jobs} == {layout.run_id}


# --- seed 004: a wait with no deadline and no liveness check ----------------------------------------------------


NAIVE_WAITERS = {
    # Poll for the done-marker until it shows up: never, if the rank died before writing it.
    "poll_marker_no_deadline": """
        import os, sys, time
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
    """,
    # DeepSpeed's DecoupledCheckpointEngine.commit(): save_event.wait() with no timeout, writer already dead.
    "event_wait_dead_writer": """
        import multiprocessing as mp, os
        ctx = mp.get_context("fork")
        saved = ctx.Event()
        writer = ctx.Process(target=os._exit, args=(1,))
        writer.start()
        writer.join()
        saved.wait()
    """,
}


@pytest.mark.parametrize("waiter", sorted(NAIVE_WAITERS))
def test_seed004_unguarded_wait_without_deadline_hangs(tmp_path: Path, waiter: str) -> None:
    """A rank never writes its marker: a waiter with no deadline or liveness check is still waiting when killed."""
    marker = tmp_path / "staging" / "step_4" / "rank_1.done.json"
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(NAIVE_WAITERS[waiter]), str(marker)], check=False, timeout=1.5
        )
    assert time.monotonic() - t0 >= 1.5
    assert not marker.exists()


def _stage_step_missing_rank1_marker(layout: RunLayout, step: int) -> None:
    sh.stage_rank(layout, step, 0, world=2, attempt=TRAIN_ATTEMPT)
    sh.stage_rank(layout, step, 1, world=2, attempt=TRAIN_ATTEMPT, marker=False)  # files written, then the rank died


def _assert_step_left_uncommitted(layout: RunLayout, step: int) -> None:
    assert not layout.latest.exists(), "latest must not be written"
    assert not layout.committed_step(step).exists()
    assert layout.staged_step(step).is_dir(), "an incomplete step stays staged (not quarantined, not published)"
    assert list(layout.quarantine.iterdir()) == []
    rec = read_record(layout, "verify_manifest")
    assert rec is not None and rec["status"] == "failed"


def test_seed004_pipeline_missing_marker_fails_at_deadline(make_run: RunFactory) -> None:
    """Train still alive, rank 1's marker never comes: verify gives up at marker_deadline_s, naming rank and step."""
    cfg, layout = make_run("checkpoint.marker_deadline_s=1")
    _start_train_record(layout)  # this test process stands in for the live train job
    _stage_step_missing_rank1_marker(layout, 4)
    t0 = time.monotonic()
    with pytest.raises(VerificationError) as excinfo:
        _verify(cfg, layout)
    elapsed = time.monotonic() - t0
    msg = str(excinfo.value)
    assert 1.0 <= elapsed < 10.0, f"deadline of 1s not honoured: verify took {elapsed:.2f}s"
    assert "deadline of 1s passed" in msg
    assert "step 4" in msg and "rank(s) 1 wrote no done-marker" in msg, msg
    assert str(layout.staged_step(4)) in msg
    _assert_step_left_uncommitted(layout, 4)


def test_seed004_pipeline_dead_train_fails_fast_despite_long_deadline(make_run: RunFactory) -> None:
    """Liveness check: the train record says running but its process is gone, so verify does not wait 60 s."""
    cfg, layout = make_run("checkpoint.marker_deadline_s=60")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _start_train_record(layout, pid=dead.pid)
    _stage_step_missing_rank1_marker(layout, 4)
    t0 = time.monotonic()
    with pytest.raises(VerificationError) as excinfo:
        _verify(cfg, layout)
    assert time.monotonic() - t0 < 10.0
    msg = str(excinfo.value)
    assert "the producer is no longer running" in msg and "step 4" in msg and "rank(s) 1 wrote no done-marker" in msg, (
        msg
    )
    _assert_step_left_uncommitted(layout, 4)


def test_seed004_pipeline_waits_for_late_marker(make_run: RunFactory) -> None:
    """The bounded wait is a real wait: a marker arriving before the deadline gets the step committed."""
    cfg, layout = make_run("checkpoint.marker_deadline_s=10")
    _start_train_record(layout)
    _stage_step_missing_rank1_marker(layout, 4)
    late = threading.Timer(0.6, sh.stage_rank, args=(layout, 4, 1), kwargs={"world": 2, "attempt": TRAIN_ATTEMPT})
    late.start()
    t0 = time.monotonic()
    try:
        summary = _verify(cfg, layout)
    finally:
        late.join()
    assert 0.5 <= time.monotonic() - t0 < 10.0
    assert {k: summary[k] for k in ("committed", "latest")} == {"committed": [4], "latest": 4}
    _assert_committed(layout, 4, {"__0_0.distcp", ".metadata", "__1_0.distcp"})


# --- integrity: a file changed after its marker was written ----------------------------------------------------


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[0] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 7)


@pytest.mark.parametrize("damage", [_flip_bytes, _truncate], ids=["flip_bytes", "truncate"])
def test_corrupted_file_is_quarantined_and_latest_unchanged(
    make_run: RunFactory, damage: Callable[[Path], None]
) -> None:
    cfg, layout = make_run()
    for rank in range(2):
        sh.stage_rank(layout, 4, rank, world=2, attempt=TRAIN_ATTEMPT)
    _verify(cfg, layout)
    latest_before = layout.latest.read_bytes()
    assert read_latest(layout).step == 4  # type: ignore[union-attr]

    for rank in range(2):
        sh.stage_rank(layout, 8, rank, world=2, attempt=TRAIN_ATTEMPT)
    bad = layout.staged_step(8) / "__1_0.distcp"
    damage(bad)  # after rank 1's marker recorded its size and hash

    with pytest.raises(VerificationError) as excinfo:
        _verify(cfg, layout)
    msg = str(excinfo.value)
    assert "QUARANTINED" not in msg and "step 8" in msg and "__1_0.distcp" in msg, msg
    assert "latest stays at step 4" in msg

    assert layout.latest.read_bytes() == latest_before, "latest is unchanged"
    assert not layout.committed_step(8).exists()
    assert not layout.staged_step(8).exists()
    [quarantined] = list(layout.quarantine.iterdir())
    assert quarantined.name.startswith("step_8.")
    assert str(quarantined) in msg
    reason = read_json(quarantined / "quarantine.json")
    assert reason["step"] == 8 and "__1_0.distcp" in reason["reason"]
    assert (quarantined / "rank_1.done.json").exists(), "quarantine keeps everything (never deletes)"
    assert not (quarantined / MANIFEST).exists()
    # The committed step 4 still verifies, and with nothing newer staged verify's done-check holds again.
    assert verify_manifest.is_done(cfg, layout) is not None


def test_marker_copied_under_another_ranks_name_is_quarantined(tmp_path) -> None:
    """A marker must name its own rank, and no two markers may claim one file (else a shard escapes checking)."""
    import shutil

    from pipeline.checkpoint.manifest import Marker, marker_path, write_marker
    from pipeline.config.compose import load_config
    from pipeline.driver.task import execute_task
    from pipeline.errors import VerificationError
    from pipeline.rundir.layout import RunLayout
    from pipeline.storage.integrity import describe

    cfg = load_config(["+experiment=tiny", f"run.root={tmp_path}", "run.id=r", "checkpoint.marker_deadline_s=1"])
    layout = RunLayout.for_run(cfg.run.root, cfg.experiment, "r")
    execute_task("prepare_dirs", cfg, str(layout.run_dir), "a0")
    staged = layout.staged_step(4)
    staged.mkdir(parents=True)
    (staged / "__0_0.distcp").write_bytes(b"rank0")
    (staged / "__1_0.distcp").write_bytes(b"garbage")
    entry = describe(staged, "__0_0.distcp")
    write_marker(staged, Marker(step=4, rank=0, world_size=2, format="torch_dcp", attempt="t1", files=(entry,)))
    shutil.copy(marker_path(staged, 0), marker_path(staged, 1))
    with pytest.raises(VerificationError, match="claims rank 0"):
        execute_task("verify_manifest", cfg, str(layout.run_dir), "v1")
    assert not layout.latest.exists()
    assert len(list(layout.quarantine.iterdir())) == 1
