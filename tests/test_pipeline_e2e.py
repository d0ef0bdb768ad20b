"""The whole pipeline through its CLI, with real processes (submitit local executor, gloo, DCP)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.config.compose import load_config
from pipeline.formats.dcp import load_into
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import read_json
from pipeline.storage.integrity import hash_file
from pipeline.workload.data import load_tokenizer
from pipeline.workload.model import build_model
from tests.conftest import run_cli, snapshot, train_losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _run(tmp_path: Path, run_id: str, *extra: str, env: dict[str, str] | None = None) -> str:
    proc = run_cli("+experiment=tiny", f"run.root={tmp_path}", f"run.id={run_id}", "run.create=true", *extra, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _layout(tmp_path: Path, run_id: str) -> RunLayout:
    return RunLayout.for_run(tmp_path, "tiny", run_id)


SHARED_RUN = pytest.mark.xdist_group("e2e_ddp_run")
"""On every test that reads ``ddp_run``: one xdist worker runs them all, so the run is made once."""


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("ddp")
    out = _run(root, "ddp")
    return root, out


@SHARED_RUN
def test_run_prints_where_results_are(ddp_run: tuple[Path, str]) -> None:
    root, out = ddp_run
    layout = _layout(root, "ddp")
    assert f"manifest: {layout.committed_step(8) / 'manifest.json'}" in out
    assert "latest:" in out and "-> step 8" in out
    assert f"export:   {layout.export_step(8)}" in out


@SHARED_RUN
def test_logs_hold_job_folders_only_no_literal_percent_j_or_empty_controller_log(ddp_run: tuple[Path, str]) -> None:
    layout = _layout(ddp_run[0], "ddp")
    stage_logs = [p for p in layout.logs.iterdir() if p.name != "leases"]
    assert stage_logs, "every stage that ran has its log folder"
    for stage in stage_logs:
        names = {p.name for p in stage.iterdir()}
        assert "%j" not in names, f"{stage}: submitit's literal %j folder was left behind"
        log = stage / "controller.err"
        assert not log.exists() or log.stat().st_size > 0, f"{log} is empty: nothing to keep"
        assert any(p.is_dir() and p.name.isdigit() for p in stage.iterdir()), f"{stage}: no job folder"


@SHARED_RUN
def test_manifest_matches_files_and_latest_is_committed(ddp_run: tuple[Path, str]) -> None:
    layout = _layout(ddp_run[0], "ddp")
    latest = read_latest(layout)
    assert latest is not None and latest.step == 8
    for step in (4, 8):
        step_dir = layout.committed_step(step)
        manifest = read_manifest(step_dir)
        assert manifest.world_size == 2 and manifest.step == step
        assert {f.path for f in manifest.files} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
        for f in manifest.files:
            assert (step_dir / f.path).stat().st_size == f.size
            assert hash_file(step_dir / f.path) == f.hash
    assert hash_file(layout.committed_step(8) / "manifest.json") == latest.manifest_hash
    assert not any(layout.staging.iterdir()), "committed steps leave staging"
    records = {p.stem: read_json(p) for p in layout.stages.glob("*.json")}
    assert {k: r["status"] for k, r in records.items()} == dict.fromkeys(
        ["prepare_dirs", "train", "verify_manifest", "consolidate", "export"], "succeeded"
    )
    assert records["train"]["world_size"] == 2 and records["train"]["summary"]["saved"] == [4, 8]


@SHARED_RUN
def test_export_loads_in_transformers_with_identical_logits(ddp_run: tuple[Path, str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    layout = _layout(ddp_run[0], "ddp")
    export_dir = layout.export_step(8)
    index = read_json(export_dir / "model.safetensors.index.json")
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, "tiny export uses max_shard_size=200KB and must be sharded"
    provenance = read_json(export_dir / "provenance.json")
    assert provenance["source"]["step"] == 8
    assert provenance["source"]["manifest_hash"] == read_latest(layout).manifest_hash  # type: ignore[union-attr]

    model = AutoModelForCausalLM.from_pretrained(str(export_dir), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(export_dir), local_files_only=True)
    ids = tokenizer("the robot reads the old book at night .", return_tensors="pt").input_ids

    cfg = load_config(["+experiment=tiny"])
    reference = build_model(cfg.model, load_tokenizer(layout.assets)).eval()
    state = {"model": reference.state_dict()}
    load_into(state, layout.committed_step(8), no_dist=True)
    reference.load_state_dict(state["model"])
    untrained = build_model(cfg.model, load_tokenizer(layout.assets)).eval()
    with torch.no_grad():
        got, want, before = model(ids).logits, reference(ids).logits, untrained(ids).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, before), "the export must hold trained weights"


@SHARED_RUN
def test_rerun_writes_nothing(ddp_run: tuple[Path, str]) -> None:
    root, _ = ddp_run
    layout = _layout(root, "ddp")
    before = snapshot(layout.run_dir)
    out = _run(root, "ddp")
    for stage in ("prepare_dirs", "train", "verify_manifest", "consolidate", "export"):
        assert f"skip {stage}:" in out
    out = _run(root, "ddp", "stage=consolidate")
    assert "skip consolidate:" in out
    assert snapshot(layout.run_dir) == before


@SHARED_RUN
def test_continue_needs_only_the_run_id(ddp_run: tuple[Path, str]) -> None:
    """``run.id=<id>`` and ``run.id=last`` replay the run's recorded overrides: no +experiment needed."""
    root, _ = ddp_run
    layout = _layout(root, "ddp")
    before = snapshot(layout.run_dir)
    for run_id in ("ddp", "last"):
        proc = run_cli(f"run.root={root}", f"run.id={run_id}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"run ddp: {layout.run_dir}" in proc.stdout and "skip export:" in proc.stdout
    assert snapshot(layout.run_dir) == before


@SHARED_RUN
def test_a_rerun_composes_and_plans_once_and_hashes_the_committed_step_once(
    ddp_run: tuple[Path, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline import cli
    from pipeline.checkpoint import manifest
    from pipeline.checkpoint.stores import posix_store
    from pipeline.config import compose
    from pipeline.driver import plan, runner

    calls = {"compose": 0, "make_plan": 0, "verify_committed": 0}

    def counted(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    for mod, name, key in (
        (plan, "make_plan", "make_plan"),
        (runner, "make_plan", "make_plan"),
        (cli, "make_plan", "make_plan"),
        (compose, "compose_dict", "compose"),  # load_config's composition
        (cli, "to_typed", "compose"),  # Hydra's task typing its own composition again
        (manifest, "verify_committed", "verify_committed"),
        (posix_store, "verify_committed", "verify_committed"),
    ):
        monkeypatch.setattr(mod, name, counted(key, getattr(mod, name)))
    root, _ = ddp_run
    assert cli.main([f"run.root={root}", "run.id=ddp"]) == 0, capsys.readouterr()
    assert calls == {"compose": 1, "make_plan": 1, "verify_committed": 1}, calls


@SHARED_RUN
def test_status_shows_owner_records_and_latest(ddp_run: tuple[Path, str]) -> None:
    root, _ = ddp_run
    proc = run_cli(f"run.root={root}", "run.id=ddp", "status=true")
    assert proc.returncode == 0, proc.stderr
    assert "owner:      none" in proc.stdout and "latest: step 8" in proc.stdout
    assert re.search(r"^  train +succeeded ", proc.stdout, re.M), proc.stdout  # the same view as pipeline.status
    assert "next launch:" in proc.stdout and "skip train:" in proc.stdout
    # each step's recorded loss is a column (best-k retention ranks by it)
    assert re.search(r"^ +committed +files +size +shared +format +loss", proc.stdout, re.M), proc.stdout


@SHARED_RUN
def test_each_step_records_the_mean_loss_since_the_last_save(ddp_run: tuple[Path, str]) -> None:
    root, _ = ddp_run
    layout = _layout(root, "ddp")
    losses = train_losses(layout)
    for step, since in ((4, range(1, 5)), (8, range(5, 9))):
        recorded = read_manifest(layout.committed_step(step)).metrics
        assert recorded.keys() == {"loss"}, recorded
        assert recorded["loss"] == pytest.approx(sum(losses[str(s)] for s in since) / 4, rel=1e-6), (step, losses)


@SHARED_RUN
def test_continue_refuses_identity_change_and_unknown_ids(ddp_run: tuple[Path, str]) -> None:
    root, _ = ddp_run
    layout = _layout(root, "ddp")
    before = snapshot(layout.run_dir)
    proc = run_cli(f"run.root={root}", "run.id=ddp", "model.hidden_size=32")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "model.hidden_size: the run was created with 64, this launch gives 32" in proc.stderr
    assert "keeps the config it was created with" in proc.stderr
    proc = run_cli(f"run.root={root}", "run.id=ddq")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "unknown run id 'ddq'" in proc.stderr and "newest: ddp" in proc.stderr
    assert snapshot(layout.run_dir) == before
    assert not (root / "tiny" / "ddq").exists()


def test_overwrite_by_prepare_dirs_alone_keeps_the_run_known(tmp_path: Path) -> None:
    """``stage=prepare_dirs run.overwrite=true`` starts the run over, and ``run.id=<id>`` still continues it."""
    _run(tmp_path, "o", "stage=prepare_dirs", "launcher=inprocess")
    layout = _layout(tmp_path, "o")
    old_step = layout.staged_step(4)
    old_step.mkdir()
    proc = run_cli(f"run.root={tmp_path}", "run.id=o", "stage=prepare_dirs", "run.overwrite=true", "launcher=inprocess")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not old_step.exists(), "the overwrite deleted the old run's content"
    assert layout.run_yaml.is_file()
    proc = run_cli(f"run.root={tmp_path}", "run.id=o", "launcher=local", "dry_run=true")
    assert proc.returncode == 0, proc.stderr
    assert f"plan for run o ({layout.run_dir})" in proc.stdout


@SHARED_RUN
def test_force_redoes_one_stage_and_keeps_the_old_output(ddp_run: tuple[Path, str]) -> None:
    root, _ = ddp_run
    layout = _layout(root, "ddp")
    old = load_file(str(layout.consolidated_step(8) / "model.safetensors"))
    out = _run(root, "ddp", "stage=consolidate", "force=true", "launcher=inprocess")
    assert "run  consolidate" in out
    new = load_file(str(layout.consolidated_step(8) / "model.safetensors"))
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    assert len(list((layout.consolidated / ".retired").iterdir())) == 1


def test_failed_shard_save_does_not_stop_training_and_is_never_committed(tmp_path: Path) -> None:
    fault = {"PIPELINE_FAULTS": "shard_save.before_marker@rank=1@step=4"}
    _run(tmp_path, "f", "stage=prepare_dirs")
    _run(tmp_path, "f", "stage=train", env=fault)
    layout = _layout(tmp_path, "f")
    rec = read_json(layout.stage_record("train"))
    assert rec["status"] == "succeeded" and rec["summary"]["failed_saves"] == [4]
    assert rec["summary"]["save_errors"]["4"].startswith("rank 1: InjectedFault: injected fault at shard_save")
    _run(tmp_path, "f", "stage=verify_manifest", "checkpoint.marker_deadline_s=1")
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    assert not layout.committed_step(4).exists(), "a step with a missing marker must never be committed"


STRATEGIES = {
    "ddp": ("strategy=ddp",),
}
"""FSDP2 and DeepSpeed ZeRO-3 resume bit-identically in tests/test_byo.py (with other models: a Mistral config
under FSDP2, tied GPT-2 under ZeRO-3); ZeRO-1/2/3 <-> FSDP2 and world-size changes in test_resume_anywhere.py."""


@SHARED_RUN
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_interrupted_run_resumes_bit_identical(tmp_path: Path, strategy: str, ddp_run: tuple[Path, str]) -> None:
    if strategy == "ddp":  # the module's uninterrupted DDP run is the same run: shared, not trained again
        shutil.copytree(_layout(ddp_run[0], "ddp").run_dir, _layout(tmp_path, "full").run_dir, symlinks=True)
    else:
        _run(tmp_path, "full", *STRATEGIES[strategy])
    out = _run(tmp_path, "split", *STRATEGIES[strategy], "train.stop_after_step=4")
    assert "-> step 4" in out
    split = _layout(tmp_path, "split")
    assert read_json(split.stage_record("train"))["summary"]["last_step"] == 4
    # Dry run of the continuation (only the run id: strategy and experiment are replayed from run.yaml) ...
    dry = run_cli(f"run.root={tmp_path}", "run.id=split", "dry_run=true")
    assert dry.returncode == 0, dry.stderr
    planned = [line.split()[:2] for line in dry.stdout.splitlines() if line.startswith(("  run ", "  skip "))]
    # ... says exactly what the runner then does.
    proc = run_cli(f"run.root={tmp_path}", "run.id=split")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = [line.split()[:2] for line in proc.stdout.splitlines() if line.startswith(("run  ", "skip "))]
    assert [[a, b.rstrip(":")] for a, b in planned] == [[a, b.rstrip(":")] for a, b in done]
    assert ["skip", "prepare_dirs"] in [[a, b.rstrip(":")] for a, b in done] and ["run", "train"] in done
    rec = read_json(split.stage_record("train"))
    assert rec["summary"]["resumed_from"] == 4
    full = load_file(str(_layout(tmp_path, "full").consolidated_step(8) / "model.safetensors"))
    resumed = load_file(str(split.consolidated_step(8) / "model.safetensors"))
    assert full.keys() == resumed.keys()
    mismatched = [k for k in full if not torch.equal(full[k], resumed[k])]
    assert not mismatched, f"resumed run differs in {mismatched}"
    full_losses = train_losses(_layout(tmp_path, "full"))
    assert train_losses(split) == {k: v for k, v in full_losses.items() if int(k) > 4}
    if strategy == "ddp":  # extending a finished run trains on from latest
        proc = run_cli(f"run.root={tmp_path}", "run.id=split", "train.steps=12")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert read_json(split.stage_record("train"))["summary"]["resumed_from"] == 8
        assert read_latest(split).step == 12  # type: ignore[union-attr]
        assert (split.export_step(12) / "provenance.json").exists()


def test_killed_rank_keeps_committed_step_and_rerun_resumes(tmp_path: Path) -> None:
    """Rank 1 dies (os._exit) while saving step 8: train fails fast, verify still commits step 4 (after_any),
    the error names the step and the rank, and a plain rerun resumes from step 4 and finishes."""
    kill = {"PIPELINE_FAULTS": "shard_save.before_marker@rank=1@step=8@action=exit"}
    proc = run_cli("+experiment=tiny", f"run.root={tmp_path}", "run.id=k", "run.create=true", env=kill)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL train" in proc.stdout and "rank 1 died first without a result or a Python error" in proc.stdout
    assert "step 8: rank(s) 1 wrote no done-marker" in proc.stdout
    # consolidate waits for train and the committer: whichever failure is seen first skips it
    skipped = r"^skip consolidate: (train|verify_manifest|train, verify_manifest) did not succeed$"
    assert re.search(skipped, proc.stdout, re.M), proc.stdout
    assert "failed; latest = step 4; after fixing the cause, resume: python -m pipeline run.id=k" in proc.stdout
    layout = _layout(tmp_path, "k")
    assert read_latest(layout).step == 4  # type: ignore[union-attr]
    assert read_json(layout.stage_record("train"))["status"] == "failed"

    _run(tmp_path, "k")
    assert read_json(layout.stage_record("train"))["summary"]["resumed_from"] == 4
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    assert (layout.export_step(8) / "provenance.json").exists()


@SHARED_RUN
def test_train_ranks_are_forked_by_their_controller_each_with_its_own_logs(ddp_run: tuple[Path, str]) -> None:
    """The tiny run's train job (2 ranks on gloo) forked its ranks from one import (``launcher.fork_tasks``): its
    controller named them in the job folder, and each rank's log files are its own."""
    from launchers.local_forks import forked_tasks  # noqa: PLC0415

    train = _layout(ddp_run[0], "ddp").logs / "train"
    (job,) = [p for p in train.iterdir() if p.is_dir() and p.name.isdigit()]
    pids = forked_tasks(job, job.name)
    assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2, pids
    for rank in (0, 1):
        err = (job / f"{job.name}_{rank}_log.err").read_text()
        assert f"[rank {rank}]" in err and f"[rank {1 - rank}]" not in err, f"rank {rank}'s log:\n{err[-2000:]}"
