"""A 2-D parallel state (FSDP2 over "dp" x tensor parallel over "tp", DTensors on a 2x2 CPU mesh over gloo)
through the library, with ``examples/fsdp2_tp_train.py`` launched by ``torchrun`` as a user would.

The reference runs 4 ranks at dp=2, tp=2 uninterrupted and writes every parameter's ``full_tensor()`` at the
end. The split run stops after a committed step and is relaunched at the same degrees: bit-identical losses.
From that committed step, relaunches at other degrees (dp=1, tp=2 on 2 ranks: another world size; dp=4, tp=1
on 4 ranks: the same world size, another mesh) resume with losses equal to the reference's within the
collectives' rounding (DCP reshards each DTensor by its global shape). ``pipeline.status --verify``,
``pipeline.consolidate`` (the streaming path: the consolidated tensors equal the gathered full parameters) and
``pipeline.export`` read the 2-D steps.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoint.manifest import read_latest
from pipeline.storage.layout import CheckpointLayout
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.xdist_group("two_d")]

STEPS, EVERY, SPLIT = 12, 4, 8
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ROUNDING = {"rtol": 1e-5, "atol": 0.0}
"""Another degree sums the same float32 partial results in another order (all-reduce over "tp", reduce-scatter
over "dp"): a few ulps per step, which the following steps carry; 1e-5 relative is about 100 float32 ulps."""


def _run(out: Path, dp: int, tp: int, steps: int, *extra: str) -> dict[int, str]:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(dp * tp), "examples/fsdp2_tp_train.py"]
    cmd += ["--out", str(out), "--dp", str(dp), "--tp", str(tp), "--steps", str(steps), "--every", str(EVERY)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*cmd, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)$", done.stdout, re.M)}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[int, str], Path]]:
    """The reference (uninterrupted), the split run (stopped at step SPLIT, relaunched), and a copy of the split
    run's directory at step SPLIT for each relaunch at other degrees."""
    base = tmp_path_factory.mktemp("two_d")
    ref = _run(base / "ref", 2, 2, STEPS, "--full-params", str(base / "ref_full.safetensors"))
    first = _run(base / "split", 2, 2, SPLIT)
    assert read_latest(CheckpointLayout(base / "split")).step == SPLIT  # type: ignore[union-attr]
    for name in ("dp1_tp2", "dp4_tp1"):
        shutil.copytree(base / "split", base / name)
    second = _run(base / "split", 2, 2, STEPS, "--full-params", str(base / "split_full.safetensors"))
    return {"ref": (ref, base / "ref"), "first": (first, base / "split"), "split": (second, base / "split")}


def test_resumed_at_the_same_degrees_the_losses_are_bit_identical(
    runs: dict[str, tuple[dict[int, str], Path]],
) -> None:
    ref, first, second = runs["ref"][0], runs["first"][0], runs["split"][0]
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert first == {s: ref[s] for s in range(1, SPLIT + 1)}
    assert second == {s: ref[s] for s in range(SPLIT + 1, STEPS + 1)}, "losses differ after the resume"
    full = runs["split"][1].parent
    mine, theirs = load_file(full / "split_full.safetensors"), load_file(full / "ref_full.safetensors")
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)


@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (4, 1)])
def test_resumed_at_other_degrees_the_losses_agree_within_the_collectives_rounding(
    runs: dict[str, tuple[dict[int, str], Path]], dp: int, tp: int
) -> None:
    ref, split_dir = runs["ref"][0], runs["split"][1]
    resumed = _run(split_dir.parent / f"dp{dp}_tp{tp}", dp, tp, STEPS)
    assert sorted(resumed) == list(range(SPLIT + 1, STEPS + 1)), f"resumed from {min(resumed) - 1}, not {SPLIT}"
    got = torch.tensor([float(resumed[s]) for s in sorted(resumed)], dtype=torch.float64)
    want = torch.tensor([float(ref[s]) for s in sorted(resumed)], dtype=torch.float64)
    torch.testing.assert_close(got, want, **ROUNDING)


def test_the_clis_verify_consolidate_and_export_a_2d_state(runs: dict[str, tuple[dict[int, str], Path]]) -> None:
    out = runs["split"][1]
    layout = CheckpointLayout(out)
    status = _cli("pipeline.status", str(out), "--verify")
    assert f"latest: step {STEPS}" in status.stdout and "verify: 3 of 3 committed step(s) ok" in status.stdout

    _cli("pipeline.consolidate", str(out))
    consolidated = load_file(layout.consolidated_step(STEPS) / "model.safetensors")
    full = load_file(out.parent / "split_full.safetensors")  # the run's own full_tensor() of each parameter
    assert consolidated.keys() == full.keys()
    for name, tensor in full.items():
        assert consolidated[name].equal(tensor), f"{name}: consolidated differs from the gathered parameter"
    assert any(t.dim() == 2 for t in full.values())  # row-wise layers: chunks with offsets in both dims

    _cli("pipeline.export", str(out), "--max-shard-size", "8KB")
    export = layout.export_step(STEPS)
    index = json.loads((export / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    exported = {k: v for s in shards for k, v in load_file(export / s).items()}
    assert len(shards) > 1 and exported.keys() == full.keys() and all(exported[k].equal(full[k]) for k in full)
