"""A train (or import) that commits nothing launches no consolidate: the committer beside it runs after any outcome,
so its success says nothing of train's, and the stages after it also wait for train itself (afterok)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config.compose import load_config
from pipeline.driver.plan import followed, make_plan
from pipeline.errors import PipelineError
from pipeline.rundir.layout import RunLayout
from pipeline.stages import consolidate, get_stage
from tests.conftest import RunFactory, run_cli


def test_stages_after_the_committer_also_wait_for_what_it_commits(tmp_path: Path) -> None:
    cfg = load_config(["+experiment=tiny", f"run.root={tmp_path}", "run.id=r", "launcher=slurm", "dry_run=true"])
    plan = make_plan(cfg, RunLayout.for_run(tmp_path, "tiny", "r"))
    assert {s.name: s.dependencies() for s in plan.stages if s.runs} == {
        "prepare_dirs": "-",
        "train": "afterok:prepare_dirs",
        "verify_manifest": "after:train",  # starts with train and commits whatever train staged, however it ends
        "consolidate": "afterok:train,afterok:verify_manifest",
        "export": "afterok:consolidate",
    }
    # an import run: consolidate waits for the import as well (train is not in that plan)
    assert followed(get_stage("consolidate").CONTRACT) == ("import_checkpoint", "train", "verify_manifest")
    assert followed(get_stage("verify_manifest").CONTRACT) == ("import_checkpoint", "train")


def test_consolidate_with_no_committed_step_says_so_in_one_line(make_run: RunFactory) -> None:
    cfg, layout = make_run()
    with pytest.raises(PipelineError) as info:
        consolidate.check_inputs(cfg, layout)
    message = str(info.value)
    assert message.startswith("nothing to consolidate: no step of run r1 is committed") and "\n" not in message
    assert "python -m pipeline.status" in message and "resume: python -m pipeline run.id=r1" in message


@pytest.mark.slow
@pytest.mark.distributed
def test_train_that_fails_before_any_commit_launches_no_consolidate(tmp_path: Path) -> None:
    """Train fails at its start (a corpus too small for the batch): the committer beside it ends well with nothing
    committed, and consolidate and export are skipped instead of started."""
    proc = run_cli(
        "+experiment=tiny",
        f"run.root={tmp_path}",
        "run.id=n",
        "run.create=true",
        "data.num_documents=1",
        "strategy.world_size=1",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL train" in proc.stdout and "the data gives only" in proc.stdout
    assert "skip consolidate: train did not succeed" in proc.stdout
    assert "run  consolidate" not in proc.stdout and "FAIL consolidate" not in proc.stdout
    assert "failed; latest = none" in proc.stdout
