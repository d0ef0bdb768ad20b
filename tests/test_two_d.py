"""A 2-D parallel state (FSDP2 over "dp" x tensor parallel over "tp", DTensors on a 2x2 CPU mesh over gloo)
through the library, with ``examples/fsdp2_tp_train.py`` launched by ``torchrun`` as a user would.

The reference runs 4 ranks at dp=2, tp=2 uninterrupted and writes every parameter's ``full_tensor()`` at the
end. The split run (with the fast tier on) stops after a committed step and is relaunched at the same degrees:
restored from its fast copies, bit-identical losses. From that committed step, relaunches at other degrees
(dp=1, tp=2 on 2 ranks: another world size; dp=4, tp=1 on 4 ranks: the same world size, another mesh) resume
from the durable step with losses equal to the reference's within the collectives' rounding (DCP reshards each
DTensor by its global shape); at dp=4, tp=1 the fast copies (this rank's shards, not resharded) are refused in
one line first. ``pipeline.status --verify``, ``pipeline.consolidate`` (the streaming paths: the consolidated
tensors equal the gathered full parameters) and ``pipeline.export`` read the 2-D steps.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoint.manifest import read_latest
from pipeline.formats.dcp_stream import MODEL_PREFIX, TensorStreamer
from pipeline.storage.layout import CheckpointLayout
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.xdist_group("two_d")]

STEPS, EVERY, SPLIT = 12, 4, 8
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RTOL = 1e-5
"""Another degree sums the same float32 partial results in another order (all-reduce over "tp", reduce-scatter
over "dp"): a few ulps per step, which the following steps carry; 1e-5 relative is about 100 float32 ulps."""


def _run(out: Path, dp: int, tp: int, steps: int, *extra: str) -> tuple[dict[int, str], str]:
    """The example's losses and its stderr."""
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(dp * tp), "examples/fsdp2_tp_train.py"]
    cmd += ["--out", str(out), "--dp", str(dp), "--tp", str(tp), "--steps", str(steps), "--every", str(EVERY)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*cmd, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)$", done.stdout, re.M)}
    return losses, done.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _resumed(out: Path) -> dict[str, Any]:
    return cast(dict[str, Any], json.loads((out / "checkpoints" / "resumed.json").read_text()))


@dataclass
class Runs:
    base: Path
    ref: dict[int, str]
    first: dict[int, str]
    second: dict[int, str]
    other: dict[tuple[int, int], tuple[dict[int, str], str, dict[str, Any]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The reference (uninterrupted); the split run (with a fast tier: a copy every 2 steps, one dir per rank),
    stopped at step SPLIT and relaunched at the same degrees; and relaunches from step SPLIT at other degrees:
    dp=4, tp=1 in the split run's own dir first, where its fast copies are (then the dir and the fast tier are
    put back as they were), dp=1, tp=2 in a copy of the dir."""
    base = tmp_path_factory.mktemp("two_d")
    split, nodes = base / "split", base / "nodes"
    fast = ("--fast-every", "2", "--fast-dir", str(nodes / "node{rank}"))
    ref, _ = _run(base / "ref", 2, 2, STEPS, "--full-params", str(base / "ref_full.safetensors"))
    first, _ = _run(split, 2, 2, SPLIT, *fast)
    assert read_latest(CheckpointLayout(split)).step == SPLIT  # type: ignore[union-attr]
    shutil.copytree(split, base / "dp1_tp2")
    shutil.copytree(split, base / "split_kept")
    shutil.copytree(nodes, base / "nodes_kept")
    other = {}
    losses, err = _run(split, 4, 1, STEPS, *fast)
    other[(4, 1)] = (losses, err, _resumed(split))
    shutil.rmtree(split)
    shutil.rmtree(nodes)
    (base / "split_kept").rename(split)
    (base / "nodes_kept").rename(nodes)
    losses, err = _run(base / "dp1_tp2", 1, 2, STEPS)
    other[(1, 2)] = (losses, err, {})
    second, _ = _run(split, 2, 2, STEPS, *fast, "--full-params", str(base / "split_full.safetensors"))
    return Runs(base, ref, first, second, other)


def test_resumed_at_the_same_degrees_from_the_fast_tier_the_losses_are_bit_identical(runs: Runs) -> None:
    assert sorted(runs.ref) == list(range(1, STEPS + 1))
    assert runs.first == {s: runs.ref[s] for s in range(1, SPLIT + 1)}
    assert runs.second == {s: runs.ref[s] for s in range(SPLIT + 1, STEPS + 1)}, "losses differ after the resume"
    resumed = _resumed(runs.base / "split")
    assert resumed["tier"] == "fast" and resumed["step"] == SPLIT, resumed  # the 2-D shards, from each rank's copy
    mine, theirs = load_file(runs.base / "split_full.safetensors"), load_file(runs.base / "ref_full.safetensors")
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)


@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (4, 1)])
def test_resumed_at_other_degrees_the_losses_agree_within_the_collectives_rounding(
    runs: Runs, dp: int, tp: int
) -> None:
    resumed, stderr, record = runs.other[(dp, tp)]
    assert sorted(resumed) == list(range(SPLIT + 1, STEPS + 1)), f"resumed from {min(resumed) - 1}, not {SPLIT}"
    got = torch.tensor([float(resumed[s]) for s in sorted(resumed)], dtype=torch.float64)
    want = torch.tensor([float(runs.ref[s]) for s in sorted(resumed)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0)
    if (dp, tp) == (4, 1):  # the same world size: the fast copies were there, and each was refused in one line
        assert record["tier"] == "durable" and record["step"] == SPLIT, record  # DCP resharded the durable step
        refusals = [ln for ln in stderr.splitlines() if "another parallel layout" in ln]
        assert refusals and "resuming from the durable tier" in refusals[0], stderr[-3000:]
        assert re.search(r"is the shard \[16, 32\] at \[\d+, 0\] of \[64, 32\] in the copy", refusals[0])


def test_the_clis_verify_consolidate_and_export_a_2d_state(runs: Runs) -> None:
    out = runs.base / "split"
    layout = CheckpointLayout(out)
    status = _cli("pipeline.status", str(out), "--verify")
    assert f"latest: step {STEPS}" in status.stdout and "verify: 3 of 3 committed step(s) ok" in status.stdout

    _cli("pipeline.consolidate", str(out))
    consolidated = load_file(layout.consolidated_step(STEPS) / "model.safetensors")
    full = load_file(runs.base / "split_full.safetensors")  # the run's own full_tensor() of each parameter
    assert consolidated.keys() == full.keys()
    for name, tensor in full.items():
        assert consolidated[name].equal(tensor), f"{name}: consolidated differs from the gathered parameter"
    # the streaming paths the step took: the row-wise layers' chunks are offset in both dims (assembled one tensor
    # at a time in a buffer sized to the largest tensor), everything else is full-row blocks copied as bytes
    streamer = TensorStreamer(layout.committed_step(STEPS), MODEL_PREFIX)
    two_d = {k for k, m in streamer.entries if any(any(c.offsets[1:]) for c in m.chunks)}
    assert two_d == {f"model.blocks.{i}.{n}.weight" for i in range(2) for n in ("o", "down")}
    for key, meta in streamer.entries:
        blocks = streamer.row_blocks(key, meta)
        assert (blocks is None) == (key in two_d) and (blocks is None or streamer.raw_spans(meta, blocks)), key

    _cli("pipeline.export", str(out), "--max-shard-size", "8KB")
    export = layout.export_step(STEPS)
    index = json.loads((export / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    exported = {k: v for s in shards for k, v in load_file(export / s).items()}
    assert len(shards) > 1 and exported.keys() == full.keys() and all(exported[k].equal(full[k]) for k in full)
