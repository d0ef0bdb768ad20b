"""The CLI behaves like a Hydra app: --help, --cfg, --info, completion, hydra.* overrides, one-line errors.

Every test runs ``python -m pipeline`` as a subprocess, as a user would; none of them may create anything.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli


def test_help_lists_stages_groups_and_every_key(tmp_path: Path) -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for stage in ("prepare_dirs", "train", "verify_manifest", "consolidate", "export"):
        assert f"\n  {stage} " in out
    assert "strategy: ddp, deepspeed, fsdp2 (default: ddp)" in out
    assert "launcher: inprocess, local, slurm (default: local)" in out
    assert "train.steps = 8" in out and "Total optimizer steps of the run" in out
    assert "run.id = null" in out and "launcher.progress_interval_s = 30.0" in out


def test_cfg_job_prints_the_composed_config_and_creates_nothing(tmp_path: Path) -> None:
    proc = run_cli("+experiment=tiny", f"run.root={tmp_path}", "strategy=fsdp2", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "experiment: tiny" in proc.stdout and "name: fsdp2" in proc.stdout and "hydra:" not in proc.stdout
    assert not any(tmp_path.iterdir())


def test_info_and_shell_completion(tmp_path: Path) -> None:
    proc = run_cli("--info")
    assert proc.returncode == 0 and "Hydra" in proc.stdout, proc.stderr
    proc = run_cli("-sc", "install=bash")
    assert proc.returncode == 0 and "hydra_bash_completion" in proc.stdout, proc.stderr
    query = run_cli("-sc", "query=bash", env={"COMP_LINE": "python -m pipeline +experiment=tiny train.st"})
    assert query.returncode == 0, query.stderr
    assert "train.steps=" in query.stdout.split() and "train.stop_after_step=" in query.stdout.split()


@pytest.mark.parametrize(
    "args, message",
    [
        (["train.stpes=3"], "unknown config key 'train.stpes': did you mean train.steps?"),
        (["+trian.steps=3"], "unknown config key 'trian': did you mean train?"),
        (["strategy=zero9"], "available options in 'strategy': ddp, deepspeed, fsdp2"),
        (["hydra.run.dir=/elsewhere"], "hydra.run.dir is set by the pipeline"),
        (["hydra/launcher=submitit_slurm"], "hydra/launcher is set by the pipeline"),
        (["launcher=slurm"], "sbatch is not on PATH"),
        (["launcher=inprocess"], "launcher=inprocess runs single-task stages in this process and cannot run train"),
        (["train.lr=-1"], "train.lr=-1.0 must be a finite number > 0"),
        (["run.id=nope"], "unknown run id 'nope'"),
        (["stage=train"], "add run.id=<id>"),
        (["-m", "train.seed=1,2", "run.id=x"], "drop run.id"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_creates_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    # sbatch may be installed here (the SLURM tests' cluster): a PATH of the venv alone has none
    env = {"PATH": str(Path(sys.executable).parent)} if args == ["launcher=slurm"] else None
    proc = run_cli("+experiment=tiny", f"run.root={tmp_path}", *args, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert message in lines[0], lines[0]
    assert not any(tmp_path.iterdir())


def test_nccl_without_gpus_is_refused_before_anything_runs(tmp_path: Path) -> None:
    proc = run_cli(
        "+experiment=tiny", f"run.root={tmp_path}", "strategy.backend=nccl", env={"CUDA_VISIBLE_DEVICES": ""}
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "nccl" in lines[0], proc.stderr
    assert not any(tmp_path.iterdir())


def test_missing_experiment_keeps_hydras_hint() -> None:
    proc = run_cli("experiment=tiny")
    assert proc.returncode == 2 and "+experiment=tiny" in proc.stderr, proc.stderr


def test_console_script_is_installed_and_is_the_same_app() -> None:
    exe = Path(sys.executable).parent / "pipeline"
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "Config groups" in proc.stdout, proc.stderr


def test_run_root_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    proc = run_cli("+experiment=tiny", f"run.root={tmp_path / 'file'}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "cannot create the run dir" in lines[0] and "is not a directory" in lines[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_multirun_sweep_makes_one_run_per_point_with_hydra_files_inside(tmp_path: Path) -> None:
    # one rank a point: the sweep is the point, not the rank count (a train rank is ~7 CPU-s of imports)
    sweep = ("train.seed=1,2", "train.steps=4", "export=none", "strategy.world_size=1")
    proc = run_cli("-m", "+experiment=tiny", f"run.root={tmp_path}", *sweep)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = sorted(d for d in (tmp_path / "tiny").iterdir() if (d / "run.yaml").exists())
    assert len(runs) == 2, runs
    seeds = set()
    for run in runs:
        overrides = (run / ".hydra" / "overrides.yaml").read_text()
        assert "train.steps=4" in overrides and (run / ".hydra" / "config.yaml").exists()
        seeds.add(next(s for s in ("train.seed=1", "train.seed=2") if s in overrides))
        assert (run / "consolidated" / "step_4" / "model.safetensors").exists()
    assert seeds == {"train.seed=1", "train.seed=2"}
