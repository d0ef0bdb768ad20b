"""Hostile or damaged run state that adversarial trials found (issue 6, items 2-4): planted symlinks, damage
under ``latest``, garbage in ``latest``, and the stale markers a failed forced train leaves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.driver.task import execute_task
from pipeline.errors import PipelineError, VerificationError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.records import write_record
from pipeline.stages import train, verify_manifest
from tests import seed_helpers as sh
from tests.conftest import RunFactory
from tests.test_seeds import TRAIN_ATTEMPT, _verify


def _committed_4_and_8(make_run: RunFactory) -> tuple[object, RunLayout]:
    cfg, layout = make_run()
    for step in (4, 8):
        for rank in range(2):
            sh.stage_rank(layout, step, rank, world=2, attempt=TRAIN_ATTEMPT)
    _verify(cfg, layout)
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    return cfg, layout


def _complete_step_elsewhere(tmp_path: Path, layout: RunLayout, step: int) -> Path:
    """A complete, self-consistent staged step outside the run (what an attacker would link to)."""
    other = RunLayout(tmp_path / "elsewhere")
    for rank in range(2):
        sh.stage_rank(other, step, rank, world=2, attempt=TRAIN_ATTEMPT)
    return other.staged_step(step)


def test_symlinked_staged_step_is_quarantined_never_published(make_run: RunFactory, tmp_path: Path) -> None:
    cfg, layout = make_run()
    for rank in range(2):
        sh.stage_rank(layout, 4, rank, world=2, attempt=TRAIN_ATTEMPT)
    _verify(cfg, layout)
    os.symlink(_complete_step_elsewhere(tmp_path, layout, 8), layout.staged_step(8))
    assert verify_manifest.is_done(cfg, layout) is None
    with pytest.raises(VerificationError, match=r"staging/step_8 was a symlink, not a step directory"):
        _verify(cfg, layout)
    assert read_latest(layout).step == 4  # type: ignore[union-attr]
    assert not os.path.lexists(layout.committed_step(8)) and not os.path.lexists(layout.staged_step(8))
    moved = [p for p in layout.quarantine.iterdir() if p.name.startswith("step_8.") and p.is_symlink()]
    assert moved, "the link itself is moved aside (never followed, never deleted)"
    _verify(cfg, layout)  # the next run is clean
    assert verify_manifest.is_done(cfg, layout) is not None


def test_symlinked_published_step_never_becomes_latest(make_run: RunFactory, tmp_path: Path) -> None:
    cfg, layout = make_run()
    for rank in range(2):
        sh.stage_rank(layout, 4, rank, world=2, attempt=TRAIN_ATTEMPT)
    _verify(cfg, layout)
    elsewhere = _complete_step_elsewhere(tmp_path, layout, 9)
    for rank in range(2):  # a published-looking step outside the run: a manifest and all
        sh.stage_rank(RunLayout(tmp_path / "elsewhere"), 9, rank, world=2, attempt=TRAIN_ATTEMPT)
    (elsewhere / "manifest.json").write_text("{}")
    os.symlink(elsewhere, layout.committed_step(9))
    with pytest.raises(VerificationError, match=r"checkpoints/step_9 was a symlink"):
        _verify(cfg, layout)
    assert read_latest(layout).step == 4  # type: ignore[union-attr]


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damage_under_latest_is_found_on_rerun_and_latest_moves_back(make_run: RunFactory, damage: str) -> None:
    cfg, layout = _committed_4_and_8(make_run)
    victim = layout.committed_step(8) / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-1]))
    else:
        victim.unlink()
    assert verify_manifest.is_done(cfg, layout) is None, "a plain rerun must notice"
    with pytest.raises(VerificationError, match=r"latest moved back to step 4.*__1_0\.distcp.*rerun to train again"):
        _verify(cfg, layout)
    assert read_latest(layout).step == 4  # type: ignore[union-attr]
    verify_committed(layout.committed_step(4), 4)
    assert not layout.committed_step(8).exists()
    assert any(p.name.startswith("step_8.") for p in layout.quarantine.iterdir()), "kept, never deleted"
    assert train.is_done(cfg, layout) is None, "train retrains steps 5..8"
    assert verify_manifest.is_done(cfg, layout) is not None


@pytest.mark.parametrize("garbage", [b"{not json", b"\xff\xfe", b"[]", b'{"step": "8"}', b""])
def test_garbage_latest_is_one_typed_error_then_rebuilt(make_run: RunFactory, garbage: bytes) -> None:
    cfg, layout = _committed_4_and_8(make_run)
    layout.latest.write_bytes(garbage)
    with pytest.raises(VerificationError, match=r"latest pointer .* not valid JSON|latest is malformed|malformed"):
        read_latest(layout)
    assert train.is_done(cfg, layout) is not None, "step 8 is published: only the pointer needs the committer"
    with pytest.raises(VerificationError, match=r"latest rebuilt as step 8"):
        _verify(cfg, layout)
    assert read_latest(layout).step == 8, "rebuilt from the newest step that verifies"  # type: ignore[union-attr]


def test_latest_as_symlink_is_refused_and_replaced(make_run: RunFactory, tmp_path: Path) -> None:
    cfg, layout = _committed_4_and_8(make_run)
    outside = tmp_path / "fake-latest"
    outside.write_text(layout.latest.read_text())
    layout.latest.unlink()
    os.symlink(outside, layout.latest)
    with pytest.raises(VerificationError, match="symlink"):
        read_latest(layout)
    with pytest.raises(VerificationError, match=r"latest rebuilt as step 8"):
        _verify(cfg, layout)
    assert not layout.latest.is_symlink() and read_latest(layout).step == 8  # type: ignore[union-attr]


def test_failed_forced_train_does_not_wedge_the_run(make_run: RunFactory) -> None:
    """A complete save from attempt A, then a forced attempt B that failed before saving: A's complete step is
    still a valid checkpoint. train and verify apply one rule, so train is not skipped while verify rejects."""
    cfg, layout = make_run()
    for rank in range(2):
        sh.stage_rank(layout, 8, rank, world=2, attempt="attempt-A")
    write_record(layout, "train", status="failed", attempt="attempt-B", pid=os.getpid())
    assert train.is_done(cfg, layout) is not None
    _verify(cfg, layout)
    assert read_latest(layout).step == 8  # type: ignore[union-attr]


def test_running_train_attempt_ignores_older_attempts_markers(make_run: RunFactory) -> None:
    """While attempt B runs, attempt A's markers are not B's save: neither train nor verify takes them."""
    cfg, layout = make_run()
    for rank in range(2):
        sh.stage_rank(layout, 8, rank, world=2, attempt="attempt-A")
    write_record(layout, "train", status="running", attempt="attempt-B", pid=os.getpid())
    assert train.is_done(cfg, layout) is None
    with pytest.raises(VerificationError, match=r"from attempt attempt-A \(waiting for attempt attempt-B\)"):
        _verify(cfg, layout)


def test_markers_mixing_attempts_are_never_committed(make_run: RunFactory) -> None:
    cfg, layout = make_run()
    sh.stage_rank(layout, 8, 0, world=2, attempt="attempt-A")
    sh.stage_rank(layout, 8, 1, world=2, attempt="attempt-B")
    assert train.is_done(cfg, layout) is None
    with pytest.raises(VerificationError, match="markers come from different attempts"):
        _verify(cfg, layout)
    assert read_latest(layout) is None


def test_marker_claiming_another_step_is_refused(make_run: RunFactory) -> None:
    cfg, layout = make_run()
    for rank in range(2):
        sh.stage_rank(layout, 8, rank, world=2, attempt=TRAIN_ATTEMPT)
    marker = layout.staged_step(8) / "rank_1.done.json"
    obj = json.loads(marker.read_text())
    obj["step"] = 4
    marker.write_text(json.dumps(obj))
    with pytest.raises(VerificationError, match=r"claims rank 1 of step 4"):
        _verify(cfg, layout)
    assert read_latest(layout) is None


@pytest.mark.parametrize("area", ["staging", "checkpoints"])
def test_managed_area_replaced_by_a_symlink_is_refused(make_run: RunFactory, tmp_path: Path, area: str) -> None:
    cfg, layout = make_run()
    target = layout.staging if area == "staging" else layout.checkpoints
    outside = tmp_path / f"outside-{area}"
    outside.mkdir()
    os.rename(target, tmp_path / f"moved-{area}")
    os.symlink(outside, target)
    with pytest.raises(PipelineError, match=r"run stage=prepare_dirs"):
        train.check_inputs(cfg, layout)
    with pytest.raises(PipelineError, match=r"is a symlink, where the run keeps a directory of its own"):
        execute_task("prepare_dirs", cfg, str(layout.run_dir), "prepare-again")
    assert list(outside.iterdir()) == [], "nothing was written through the link"
