"""Which local jobs fork their tasks from one import (:mod:`launchers.local_forks`), and the forked task's view
of its process. The forked train jobs themselves run in every local pipeline test (``tests/test_pipeline_e2e.py``
checks their logs and the pids file)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from launchers.local_forks import ForkedTask, forked_preload, forked_tasks
from pipeline.config.compose import load_config
from pipeline.driver.supervise import StageJob
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import Resources
from pipeline.stages import get_stage


def _job(tmp_path: Path, *overrides: str, stage: str = "train", tasks: int = 2, gpus: int = 0) -> StageJob:
    cfg = load_config(["+experiment=tiny", f"run.root={tmp_path}", "run.id=f", *overrides])
    contract = get_stage(stage).CONTRACT
    layout = RunLayout.for_run(cfg.run.root, cfg.experiment, "f")
    return StageJob(stage, contract, cfg, layout, "a1", tasks, dataclasses.replace(Resources(), gpus_per_task=gpus))


def test_a_cpu_train_job_of_two_ranks_preloads_torch_dcp_and_its_model(tmp_path: Path) -> None:
    modules = forked_preload(_job(tmp_path))
    assert "pipeline.stagekit.train_job" in modules
    assert "transformers.models.llama.modeling_llama" in modules
    gpt2 = forked_preload(_job(tmp_path, "model.config={model_type: gpt2, n_layer: 1, n_embd: 8, n_head: 2}"))
    assert "transformers.models.gpt2.modeling_gpt2" in gpt2
    assert "deepspeed" in forked_preload(_job(tmp_path, "strategy=deepspeed"))


@pytest.mark.parametrize(
    ("overrides", "kwargs"),
    [
        ((), {"tasks": 1}),  # one task gains nothing
        ((), {"gpus": 1}),  # never a fork where CUDA may be initialised
        (("strategy.backend=nccl",), {}),
        (("launcher.fork_tasks=false",), {}),
        ((), {"stage": "verify_manifest"}),  # not ranks
    ],
)
def test_other_jobs_start_each_task_as_a_new_interpreter(
    tmp_path: Path, overrides: tuple[str, ...], kwargs: dict[str, object]
) -> None:
    assert forked_preload(_job(tmp_path, *overrides, **kwargs)) == []  # type: ignore[arg-type]


def test_a_forked_task_is_polled_and_signalled_like_a_popen_and_never_after_it_was_reaped() -> None:
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    task = ForkedTask(pid)
    assert task.poll() is None
    task.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while task.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert task.returncode == -signal.SIGTERM
    task.send_signal(signal.SIGKILL)  # reaped: nothing is sent to a pid another process may have now


def test_the_pids_file_is_read_whole_or_not_at_all(tmp_path: Path) -> None:
    assert forked_tasks(tmp_path, "7") == {}
    (tmp_path / "7_tasks.json").write_text('{"0": 11, "1"')  # torn (never written so: write_json_atomic)
    assert forked_tasks(tmp_path, "7") == {}
    (tmp_path / "7_tasks.json").write_text('{"0": 11, "1": 12}')
    assert forked_tasks(tmp_path, "7") == {0: 11, 1: 12}
