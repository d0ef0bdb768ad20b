"""A crash at each I/O step of a commit leaves the last committed step loadable; a rerun completes it."""

from __future__ import annotations

import pytest

from pipeline.checkpoint.manifest import read_latest
from pipeline.errors import PipelineError
from pipeline.stages import train, verify_manifest
from pipeline.storage.faults import InjectedFault
from tests import seed_helpers as sh
from tests.conftest import RunFactory
from tests.test_seeds import TRAIN_ATTEMPT, _assert_committed, _verify


@pytest.mark.parametrize(
    "point", ["shard_save.before_marker", "verify.before_publish", "verify.before_manifest", "verify.before_latest"]
)
def test_crash_during_commit_keeps_last_step_and_rerun_completes(
    make_run: RunFactory,
    monkeypatch: pytest.MonkeyPatch,
    point: str,
) -> None:
    cfg, layout = make_run()
    step4 = {f for r in range(2) for f in sh.stage_rank(layout, 4, r, world=2, attempt=TRAIN_ATTEMPT)}
    _verify(cfg, layout)
    for rank in range(2):
        sh.stage_rank(layout, 8, rank, world=2, attempt=TRAIN_ATTEMPT, marker=point != "shard_save.before_marker")
    if point == "shard_save.before_marker":
        with pytest.raises(PipelineError, match=r"step 8.*rank\(s\) 0, 1"):
            _verify(cfg, layout)
    else:
        monkeypatch.setenv("PIPELINE_FAULTS", f"{point}@step=8")
        with pytest.raises(InjectedFault):
            _verify(cfg, layout)
        monkeypatch.delenv("PIPELINE_FAULTS")
    # The crash left step 4 as latest, intact and verifiable.
    assert read_latest(layout).step == 4  # type: ignore[union-attr]
    _assert_committed(layout, 4, step4)
    assert verify_manifest.is_done(cfg, layout) is None, "an unfinished commit must not look done"
    if point == "shard_save.before_marker":
        for rank in range(2):  # train's rerun re-saves the step
            sh.stage_rank(layout, 8, rank, world=2, attempt=TRAIN_ATTEMPT)
    else:
        assert train.is_done(cfg, layout) is not None, "train must not redo a step that only awaits its commit"
    _verify(cfg, layout)
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    assert verify_manifest.is_done(cfg, layout) is not None
