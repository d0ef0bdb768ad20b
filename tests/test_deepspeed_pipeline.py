"""``strategy=deepspeed`` end to end through the CLI: ZeRO 1 and 2 on 2 gloo ranks, committed by the pipeline
(DeepSpeed's ``latest`` off), consolidated with bounded memory to what DeepSpeed's own ``zero_to_fp32`` gives, and
exported so that ``transformers`` reproduces the trained engine's logits. ZeRO-3: in bf16 below, in fp32 with a
tied GPT-2 in tests/test_byo.py, and its consolidation against ``zero_to_fp32`` in test_deepspeed_format.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import read_json
from tests.conftest import probe_env, probe_file, read_probe, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

EXPECTED_FILES = {
    1: {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"},
    2: {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"},
    3: {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"},
}


def _run(root: Path, run_id: str, *extra: str) -> str:
    args = ("+experiment=tiny", f"run.root={root}", f"run.id={run_id}", "run.create=true", *extra)
    proc = run_cli(*args, env=probe_env(probe_file(root, run_id)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _export_logits(export_dir: Path, input_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(export_dir), local_files_only=True, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([input_ids])).logits.float()


def _zero_to_fp32(step_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(
        str(step_dir.parent), str(out), safe_serialization=True, max_shard_size=None, tag=step_dir.name
    )
    return load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("stage", [2])  # ZeRO-3: the bf16 test below, and tests/test_byo.py (tied GPT-2); ZeRO-1
# (the layout of ZeRO-2): consolidated against zero_to_fp32 in test_deepspeed_format.py, resumed through the app
# in test_resume_anywhere.py
def test_zero_stage_runs_end_to_end(tmp_path: Path, stage: int) -> None:
    out = _run(tmp_path, f"z{stage}", "strategy=deepspeed", f"strategy.zero_stage={stage}")
    layout = RunLayout.for_run(tmp_path, "tiny", f"z{stage}")
    assert "-> step 8" in out
    latest = read_latest(layout)
    assert latest is not None and latest.step == 8
    step_dir = layout.committed_step(8)
    manifest = read_manifest(step_dir)
    assert (manifest.format, manifest.world_size) == (f"deepspeed_zero{stage}", 2)
    names = {f.path for f in manifest.files}
    assert EXPECTED_FILES[stage] <= names and {"train_state_rank_0.json", "train_state_rank_1.json"} <= names
    assert not (layout.staging / "latest").exists() and not (layout.staging / "zero_to_fp32.py").exists()
    rank1 = read_json(step_dir / "rank_1.done.json")
    assert all("rank_1" in f["path"] for f in rank1["files"]), "rank 1 lists only its own files"

    # Consolidation equals DeepSpeed's own zero_to_fp32 tensor for tensor, bit for bit.
    ours = load_file(str(layout.consolidated_step(8) / "model.safetensors"))
    theirs = _zero_to_fp32(step_dir, tmp_path / "zero_to_fp32")
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)

    # The export reproduces the trained engine's logits (computed by the engine at the end of training).
    probe = read_probe(probe_file(tmp_path, layout.run_id))
    want = torch.tensor(probe["logits"]).view(probe["shape"])
    got = _export_logits(layout.export_step(8), probe["input_ids"], torch.float32)
    assert torch.equal(got, want)


def test_bf16_zero3_exports_the_engines_logits(tmp_path: Path) -> None:
    _run(
        tmp_path,
        "bf16",
        "strategy=deepspeed",
        "strategy.zero_stage=3",
        "strategy.precision=bf16",
        "export.dtype=bfloat16",
    )
    layout = RunLayout.for_run(tmp_path, "tiny", "bf16")
    manifest = read_manifest(layout.committed_step(8))
    assert manifest.format == "deepspeed_zero3"
    assert any(f.path.startswith("bf16_zero_pp_rank_") for f in manifest.files)
    ours = load_file(str(layout.consolidated_step(8) / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in ours.values()), "consolidation keeps the fp32 master weights"
    probe = read_probe(probe_file(tmp_path, layout.run_id))
    want = torch.tensor(probe["logits"]).view(probe["shape"])
    got = _export_logits(layout.export_step(8), probe["input_ids"], torch.bfloat16)
    assert torch.equal(got, want), f"max diff {(got - want).abs().max()}"


def test_rerun_writes_nothing_and_status_names_the_format(tmp_path: Path) -> None:
    # the checkpoints are what must not be rewritten: no export (export=none; ZeRO-2's is in the test above)
    _run(tmp_path, "again", "strategy=deepspeed", "strategy.zero_stage=2", "train.steps=4", "export=none")
    layout = RunLayout.for_run(tmp_path, "tiny", "again")
    before = {p: p.stat().st_mtime_ns for p in layout.checkpoints.rglob("*")}
    proc = run_cli(f"run.root={tmp_path}", "run.id=again")
    assert proc.returncode == 0, proc.stderr
    assert {p: p.stat().st_mtime_ns for p in layout.checkpoints.rglob("*")} == before
    status = run_cli(f"run.root={tmp_path}", "run.id=again", "status=true")
    assert status.returncode == 0, status.stderr
    record = json.loads((layout.committed_step(4) / "manifest.json").read_text())
    assert record["format"] == "deepspeed_zero2"
