"""The GPU path (NCCL) and the rendezvous every train task gets.

The ``gpu`` tests run the pipeline over NCCL with one rank per visible GPU; without a GPU (CI) they are skipped.
The rest runs on CPU: the device checks with ``torch.cuda`` faked, the task entry's environment inside a faked
submitit job, and single-rank / inherited-environment train jobs end to end (gloo).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launchers import submitit_launcher
from launchers.resources import INHERITED_RENDEZVOUS
from pipeline.checkpoint.manifest import read_latest
from pipeline.config.compose import load_config
from pipeline.config.launcher import LocalLauncherConfig
from pipeline.config.schema import PipelineConfig, StrategyConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.formats.dcp import load_into
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import read_json
from pipeline.strategies import process_group
from pipeline.strategies.devices import check_backend, claim_cuda_device
from pipeline.workload.data import load_tokenizer
from pipeline.workload.model import build_model
from tests.conftest import run_cli, train_losses

GPUS = torch.cuda.device_count()  # NVML: does not initialise CUDA in the test process
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device (none visible)")


# --- device checks (CPU, torch.cuda faked) -------------------------------------------------------------------


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int, built: bool = True) -> list[torch.device]:
    """``count`` visible GPUs; ``is_available`` agrees; returns the devices ``set_device`` was called with."""
    selected: list[torch.device] = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if built else 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: built and count > 0)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    return selected


def _nccl(world_size: int) -> StrategyConfig:
    return StrategyConfig(name="ddp", world_size=world_size, backend="nccl")


def test_check_backend_passes_gloo_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, count=0, built=False)
    check_backend(StrategyConfig(name="ddp", world_size=4, backend="gloo"))


def test_check_backend_passes_nccl_with_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, count=2)
    check_backend(_nccl(2))
    check_backend(_nccl(1))


def test_check_backend_refuses_nccl_on_a_cpu_build_of_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, count=0, built=False)
    with pytest.raises(ConfigError, match=r"CPU-only build: use strategy\.backend=gloo"):
        check_backend(_nccl(1))


def test_check_backend_refuses_nccl_without_a_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, count=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES=''.*use strategy\.backend=gloo") as err:
        check_backend(_nccl(1))
    assert "\n" not in str(err.value)


def test_check_backend_refuses_more_ranks_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, count=1)
    with pytest.raises(ConfigError, match=r"world_size=2 needs 2 GPUs but 1 are visible.*strategy\.world_size=1"):
        check_backend(_nccl(2))


def test_check_backend_does_not_initialise_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``is_available`` calls cudaGetDeviceCount (poisons fork in the launching process); the NVML count does not."""
    _fake_cuda(monkeypatch, count=2)

    def poisons_fork() -> bool:
        raise AssertionError("check_backend must count devices with torch.cuda.device_count (NVML)")

    monkeypatch.setattr(torch.cuda, "is_available", poisons_fork)
    check_backend(_nccl(2))


def test_claim_cuda_device_selects_the_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    selected = _fake_cuda(monkeypatch, count=2)
    assert claim_cuda_device(1, rank=3) == torch.device("cuda", 1)
    assert selected == [torch.device("cuda", 1)]


def test_claim_cuda_device_names_cuda_visible_devices_when_the_task_sees_no_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_cuda(monkeypatch, count=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what submitit's local executor sets when no GPU is requested
    with pytest.raises(PipelineError, match=r"rank 0: .*sees no CUDA device \(CUDA_VISIBLE_DEVICES=''\)"):
        claim_cuda_device(0, rank=0)


def test_claim_cuda_device_refuses_a_local_rank_past_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    selected = _fake_cuda(monkeypatch, count=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(
        PipelineError, match=r"rank 1: LOCAL_RANK=1 but .* only 1 CUDA device.*CUDA_VISIBLE_DEVICES='3'"
    ):
        claim_cuda_device(1, rank=1)
    assert selected == []


def _rendezvous_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for key in INHERITED_RENDEZVOUS:
        monkeypatch.delenv(key, raising=False)  # restored after the test, whatever the code under test set
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def test_init_distributed_sets_the_device_before_the_nccl_group(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, object]] = []
    _fake_cuda(monkeypatch, count=2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode: calls.append(("deterministic", mode)))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)

    def init_process_group(backend: str, **kwargs: object) -> None:
        calls.append(("init_process_group", (backend, kwargs["device_id"])))

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    _rendezvous_env(monkeypatch, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    device = process_group.init_distributed(_nccl(2))
    cuda1 = torch.device("cuda", 1)
    assert device == cuda1
    assert calls == [("set_device", cuda1), ("deterministic", True), ("init_process_group", ("nccl", cuda1))]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_init_distributed_nccl_needs_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, count=2)
    _rendezvous_env(monkeypatch, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK="0", WORLD_SIZE="1")
    with pytest.raises(PipelineError, match="cannot join the process group: LOCAL_RANK not set"):
        process_group.init_distributed(_nccl(1))


# --- the rendezvous variables each task gets (a faked submitit local job) -------------------------------------


def _task_env(
    monkeypatch: pytest.MonkeyPatch, cfg: PipelineConfig, stage: str, task: int, num_tasks: int, **inherited: str
) -> dict[str, str | None]:
    """Run ``task_entry`` as task ``task`` of a local submitit job; the rendezvous variables the stage saw."""
    _rendezvous_env(
        monkeypatch,
        SUBMITIT_EXECUTOR="local",
        SUBMITIT_LOCAL_JOB_ID="4242",
        SUBMITIT_LOCAL_NTASKS=str(num_tasks),
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_GLOBALID=str(task),
        SUBMITIT_LOCAL_LOCALID=str(task),
        **inherited,
    )
    seen: dict[str, str | None] = {}

    def execute_task(*args: object, **kwargs: object) -> dict[str, object]:
        seen.update({k: os.environ.get(k) for k in INHERITED_RENDEZVOUS})
        assert (kwargs["rank"], kwargs["world_size"], kwargs["job_id"]) == (task, num_tasks, "4242")
        return {}

    monkeypatch.setattr(submitit_launcher, "execute_task", execute_task)
    submitit_launcher.task_entry(stage, cfg, "/unused", "attempt-1")
    return seen


INHERITED = {  # as inside torchrun, or a shell in a SLURM allocation
    "MASTER_ADDR": "203.0.113.7",
    "MASTER_PORT": "1",
    "RANK": "5",
    "WORLD_SIZE": "9",
    "LOCAL_RANK": "3",
    "GROUP_RANK": "2",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def test_single_task_train_job_gets_its_own_rendezvous(
    monkeypatch: pytest.MonkeyPatch, tiny_cfg: PipelineConfig
) -> None:
    assert isinstance(tiny_cfg.launcher, LocalLauncherConfig)
    seen = _task_env(monkeypatch, tiny_cfg, "train", task=0, num_tasks=1, **INHERITED)
    assert seen["MASTER_ADDR"] == tiny_cfg.launcher.master_addr
    assert (seen["RANK"], seen["WORLD_SIZE"], seen["LOCAL_RANK"], seen["LOCAL_WORLD_SIZE"]) == ("0", "1", "0", "1")
    port = int(seen["MASTER_PORT"] or 0)
    assert 10000 <= port < 32768 and port != 1, "the port comes from the job id (below the ephemeral range)"
    assert seen["GROUP_RANK"] is None and seen["TORCHELASTIC_USE_AGENT_STORE"] is None


def test_tasks_of_one_job_agree_on_the_port_and_differ_in_rank(
    monkeypatch: pytest.MonkeyPatch, tiny_cfg: PipelineConfig
) -> None:
    seen = [_task_env(monkeypatch, tiny_cfg, "train", task=t, num_tasks=2, **INHERITED) for t in (0, 1)]
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]
    assert [(s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"]) for s in seen] == [("0", "0", "2"), ("1", "1", "2")]


def test_single_task_stages_get_no_rendezvous(monkeypatch: pytest.MonkeyPatch, tiny_cfg: PipelineConfig) -> None:
    seen = _task_env(monkeypatch, tiny_cfg, "consolidate", task=0, num_tasks=1, **INHERITED)
    assert set(seen.values()) == {None}


# --- end to end through the CLI --------------------------------------------------------------------------------


def _run(root: Path, run_id: str, *extra: str, create: bool = False, env: dict[str, str] | None = None) -> str:
    new = ("run.create=true",) if create else ()
    proc = run_cli("+experiment=tiny", f"run.root={root}", f"run.id={run_id}", *new, *extra, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _layout(root: Path, run_id: str) -> RunLayout:
    return RunLayout.for_run(root, "tiny", run_id)


def _assert_trained_by(
    root: Path, run_id: str, world_size: int, saved: tuple[int, ...] = (4, 8), exported: bool = True
) -> None:
    """Step 8 committed (and exported); train's record (this attempt's: a resumed one lists its own saves) agrees."""
    layout = _layout(root, run_id)
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    rec = read_json(layout.stage_record("train"))
    assert rec["status"] == "succeeded" and rec["world_size"] == world_size
    assert rec["summary"]["saved"] == list(saved) and rec["summary"]["failed_saves"] == []
    assert (layout.export_step(8) / "provenance.json").exists() or not exported


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.gpu
@needs_gpu
@pytest.mark.slow
@pytest.mark.distributed
def test_nccl_run_completes_resumes_bit_identical_and_exports(tmp_path: Path, strategy: str) -> None:
    from transformers import AutoModelForCausalLM

    on_gpu = (f"strategy={strategy}", "strategy.backend=nccl", f"strategy.world_size={GPUS}")
    _run(tmp_path, "full", *on_gpu, create=True)
    _assert_trained_by(tmp_path, "full", GPUS)

    out = _run(tmp_path, "split", *on_gpu, "train.stop_after_step=4", create=True)
    assert "-> step 4" in out
    _run(tmp_path, "split", *on_gpu)
    _assert_trained_by(tmp_path, "split", GPUS, saved=(8,))
    full, split = _layout(tmp_path, "full"), _layout(tmp_path, "split")
    rec = read_json(split.stage_record("train"))
    assert rec["summary"]["resumed_from"] == 4
    want = load_file(str(full.consolidated_step(8) / "model.safetensors"))
    got = load_file(str(split.consolidated_step(8) / "model.safetensors"))
    assert want.keys() == got.keys()
    assert not [k for k in want if not torch.equal(want[k], got[k])], "resumed run differs from the uninterrupted one"
    full_losses = train_losses(full)
    assert train_losses(split) == {k: v for k, v in full_losses.items() if int(k) > 4}

    # the export (read on CPU) holds exactly the committed step's weights
    cfg = load_config(["+experiment=tiny"])
    reference = build_model(cfg.model, load_tokenizer(full.assets)).eval()
    state = {"model": reference.state_dict()}
    load_into(state, full.committed_step(8), no_dist=True)
    reference.load_state_dict(state["model"])
    exported = AutoModelForCausalLM.from_pretrained(str(full.export_step(8)), local_files_only=True).eval()
    ids = load_tokenizer(full.assets)("the robot reads the old book at night .", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)


@pytest.mark.slow
@pytest.mark.distributed
def test_single_rank_train_gets_rendezvous_variables(tmp_path: Path) -> None:
    _run(tmp_path, "one", "strategy.world_size=1", "export=none", create=True)  # what train saw is the point
    _assert_trained_by(tmp_path, "one", 1, exported=False)


@pytest.mark.slow
@pytest.mark.distributed
def test_inherited_rendezvous_variables_do_not_break_train(tmp_path: Path) -> None:
    _run(tmp_path, "inherited", "export=none", create=True, env=INHERITED)
    _assert_trained_by(tmp_path, "inherited", 2, exported=False)
