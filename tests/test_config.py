"""Config composition and the CLI's handling of bad input (run as subprocesses, like a user)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.cli import prepare
from pipeline.config.compose import conf_dir, experiments, load_config
from pipeline.config.identity import write_run_record
from pipeline.config.schema import ExportConfig, PipelineConfig, parse_size, rank_batch_size
from pipeline.errors import ConfigError
from pipeline.rundir.layout import RunLayout
from pipeline.workload.data import SampleStream
from tests.conftest import RunFactory, run_cli


@pytest.mark.parametrize("name", experiments())
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("launcher", ["local", "inprocess", "slurm"])
def test_every_experiment_composes(name: str, strategy: str, launcher: str, pretrained_gpt2: Path) -> None:
    needs = [f"model.pretrained={pretrained_gpt2}"] if name == "finetune_lora" else []
    cfg = load_config([f"+experiment={name}", f"strategy={strategy}", f"launcher={launcher}", *needs])
    assert isinstance(cfg, PipelineConfig)
    assert cfg.strategy.name == strategy
    assert cfg.launcher.kind == launcher


def test_export_shards_at_a_real_run_size_unless_the_experiment_says_otherwise() -> None:
    """A 1B-parameter model is not cut into thousands of shards: the schema and the ``export`` group default to
    5GB; only the toy (``+experiment=tiny``) shards small, so its export still has several shards."""
    assert parse_size(ExportConfig().max_shard_size) == 5 * 10**9
    assert parse_size(OmegaConf.load(conf_dir() / "export" / "hf.yaml").max_shard_size) == 5 * 10**9
    assert load_config(["+experiment=tiny"]).export.max_shard_size == "200KB"


def _recorded_run(root: Path, *overrides: str) -> RunLayout:
    """A run dir with only the ``run.yaml`` its creating launch (``+experiment=tiny *overrides``) wrote."""
    given = ["+experiment=tiny", *overrides]
    cfg = load_config([*given, f"run.root={root}", "run.id=r"])
    layout = RunLayout.for_run(root, "tiny", "r")
    layout.run_dir.mkdir(parents=True)
    write_run_record(layout, cfg, given)
    return layout


def test_continuing_at_another_world_size_keeps_the_global_batch(tmp_path: Path) -> None:
    """A run whose global batch was derived (4 per rank x 2 ranks = 8) keeps 8 samples per step at 4 ranks, says
    so in one line, and records it; a world size that cannot split it is refused naming the key."""
    _recorded_run(tmp_path)
    p = prepare([f"run.root={tmp_path}", "run.id=r", "strategy.world_size=4"])
    assert p.cfg.train.global_batch_size == 8 and rank_batch_size(p.cfg.train, 4) == 2
    assert "train.global_batch_size=8" in p.overrides, "replayed by every later launch of the run"
    assert p.notes == (
        "run r keeps its global batch of 8 samples per step: 2 per rank on strategy.world_size=4 "
        "(train.global_batch_size=8)",
    )
    assert prepare([f"run.root={tmp_path}", "run.id=r"]).notes == (), "same world size: nothing to keep"
    with pytest.raises(ConfigError, match=r"^the run trains on a global batch of 8 .*strategy.world_size=3 does not"):
        prepare([f"run.root={tmp_path}", "run.id=r", "strategy.world_size=3"])
    with pytest.raises(ConfigError, match="train.global_batch_size: the run was created with 8, this launch gives 16"):
        prepare([f"run.root={tmp_path}", "run.id=r", "strategy.world_size=4", "train.global_batch_size=16"])


def test_missing_experiment_says_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"\+experiment=<name>.*tiny"):
        load_config([])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stpes=3", "train.stpes"),
        ("+train.stpes=3", "unknown config key 'train.stpes'"),
        ("train.steps=abc", "train.steps"),
        ("strategy.name=zero9", "strategy.name='zero9'"),
        ("export.max_shard_size=lots", "size 'lots' is not understood"),
        ("run.id=../escape", "is not a valid run id"),
        ("train.lr=-1", "train.lr=-1.0 must be a finite number > 0"),
        ("train.lr=inf", "finite"),
        ("train.stop_after_step=-2", "train.stop_after_step=-2"),
        ("train.warmup_steps=-1", "must be >= 0"),
        ("launcher.poll_interval_s=-1", "launcher.poll_interval_s=-1.0 must be > 0"),
        ("checkpoint.marker_deadline_s=-5", "checkpoint.marker_deadline_s=-5"),
        ("strategy.pg_timeout_s=0", "strategy.pg_timeout_s=0"),
        ("data.seq_len=0", "data.seq_len=0"),
        ("model.num_heads=0", "model.num_heads=0 must be >= 1"),
    ],
)
def test_bad_values_fail_before_anything_runs(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("+", r"\+").replace(".", r"\.")):
        load_config(["+experiment=tiny", override])


def test_cli_errors_are_one_line_and_nonzero(tmp_path) -> None:
    cases = [
        [],
        ["+experiment=tiny", "train.stpes=3"],
        ["+experiment=tiny", f"run.root={tmp_path}", "run.id=nope", "stage=consolidate"],
        ["+experiment=tiny", f"run.root={tmp_path}", "run.id=nope", "stage=bogus"],
        ["+experiment=tiny", f"run.root={tmp_path}", "force=true"],
    ]
    for args in cases:
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)
    assert not any(tmp_path.iterdir()), "a rejected command must not create anything"


def test_dry_run_prints_plan_and_writes_nothing(tmp_path) -> None:
    proc = run_cli("+experiment=tiny", f"run.root={tmp_path}", "dry_run=true")
    assert proc.returncode == 0, proc.stderr
    for stage in ("prepare_dirs", "train", "verify_manifest", "consolidate", "export"):
        assert f"  run  {stage} (" in proc.stdout
    assert "run  train (2 tasks; cpus/task=1" in proc.stdout and "after afterok:prepare_dirs" in proc.stdout
    assert "run  verify_manifest (1 task;" in proc.stdout and "after after:train" in proc.stdout
    assert not any(tmp_path.iterdir())


def test_too_small_corpus_names_the_keys(make_run: RunFactory) -> None:
    cfg, layout = make_run("data.num_documents=1")
    with pytest.raises(ConfigError, match=r"the data gives only \d+ training samples of data.seq_len=32 tokens"):
        SampleStream(layout.assets, cfg.data.seq_len, 0, micro_batch_size=64, rank=0, world_size=2)
