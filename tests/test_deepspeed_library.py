"""The library's DeepSpeed adapter: a plain ``torchrun`` script saves a DeepSpeed ZeRO engine with
``Checkpointer.save(step, {"engine": engine, ...})`` and resumes it with ``load_latest`` (2 CPU ranks, gloo).

A run killed after a step is relaunched and resumes from its last committed step with the losses of an
uninterrupted run, bit for bit (the engine's weights and Adam state, the data position and every rank's RNG come
back); the step is committed in DeepSpeed's own layout (``deepspeed_zero<N>``), the rest of the state as DCP files
beside it, every file listed by a marker and verified by the committer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.checkpoint.manifest import read_latest, read_manifest, verify_committed
from pipeline.storage.layout import CheckpointLayout

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
STEPS = 6
LAUNCH_TIMEOUT_S = 300

_SCRIPT = r"""
import importlib, json, os, sys
import torch, torch.distributed as dist
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo: no shm op JIT build
import deepspeed
from pipeline.checkpoint import Checkpointer, RankLocal, RankRNG

out, stage, steps, stop_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class Position:  # a data loader's position: per rank
    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": torch.tensor(self.seen)}

    def load_state_dict(self, sd):
        self.seen = int(sd["seen"])


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
config = {
    "train_micro_batch_size_per_gpu": 4, "train_batch_size": 4 * world, "zero_optimization": {"stage": stage},
    "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9,
}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
engine._copy_recovery_script = lambda *a, **k: None
torch.manual_seed(100 + rank)  # each rank's own data stream
position = Position()
state = {"engine": engine, "data": RankLocal(position, rank), "rng": RankRNG(rank)}
losses = {}
with Checkpointer(out, deadline_s=60) as ckpt:
    start = ckpt.load_latest(into=state)
    assert position.seen == start, (position.seen, start)
    for step in range(start + 1, steps + 1):
        x = torch.randn(4, 16)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        position.seen += 1
        losses[step] = loss.item()
        if step % 2 == 0:
            result = ckpt.save(step, state) if step % 4 else ckpt.save_async(step, state)
        if step == stop_after:
            break
with open(os.path.join(out, f"losses_{rank}.json"), "w") as f:
    json.dump({"start": start, "losses": losses}, f)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(script: Path, out: Path, stage: int, stop_after: int) -> dict[str, object]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--local-addr",
        "127.0.0.1",
        f"--nproc-per-node={WORLD}",
        str(script),
        str(out),
        str(stage),
        str(STEPS),
        str(stop_after),
    ]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(_free_port()),
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, output[-6000:]
    return json.loads((out / "losses_0.json").read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_engine_saved_by_the_library_resumes_bit_identically(tmp_path: Path, stage: int) -> None:
    script = tmp_path / "ds_train.py"
    script.write_text(_SCRIPT)
    whole = _launch(script, tmp_path / "whole", stage, stop_after=STEPS)
    assert whole["start"] == 0

    first = _launch(script, tmp_path / "resumed", stage, stop_after=4)
    assert first["losses"] == {k: v for k, v in whole["losses"].items() if int(k) <= 4}  # type: ignore[union-attr]
    layout = CheckpointLayout(tmp_path / "resumed")
    latest = read_latest(layout)
    assert latest is not None and latest.step == 4
    step_dir = layout.committed_step(4)
    verify_committed(step_dir, 4)
    manifest = read_manifest(step_dir)
    assert (manifest.format, manifest.world_size) == (f"deepspeed_zero{stage}", WORLD)
    listed = {f.path for f in manifest.files}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= listed, "the rest of the state is DCP beside it"
    assert any("zero_pp_rank_1" in p and p.endswith("optim_states.pt") for p in listed), listed

    second = _launch(script, tmp_path / "resumed", stage, stop_after=STEPS)
    assert second["start"] == 4
    want = {k: v for k, v in whole["losses"].items() if int(k) > 4}  # type: ignore[union-attr]
    assert second["losses"] == want, "the resumed run's losses equal the uninterrupted run's, bit for bit"
    assert read_latest(layout).step == STEPS  # type: ignore[union-attr]
