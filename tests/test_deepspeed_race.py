"""DeepSpeed's ``latest`` race, reproduced, and the pipeline's commit shown free of it.

DeepSpeed 0.19.8's ``save_checkpoint``: every rank writes its files in place, then rank 0 writes ``latest``
*before* the final barrier, so a slow rank's shard may not exist yet when ``latest`` names the tag
(``../shared/reference/cpu-distributed-probe.md`` §2c). A crash in that window leaves ``latest`` naming an
incomplete checkpoint. The pipeline turns DeepSpeed's ``latest`` off and publishes only after every rank's
marker is there and every file verifies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_RACE_SCRIPT = r"""
import os, sys, threading, time, json
import torch, torch.distributed as dist
import deepspeed
from pipeline.strategies.zero import disable_shm_comm_op
disable_shm_comm_op()  # no JIT build of the shared-memory allreduce op (gloo is used)
out = sys.argv[1]
dist.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4, "zero_optimization": {"stage": 2},
       "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
loss = engine(torch.randn(2, 32)).pow(2).mean(); engine.backward(loss); engine.step()
slow_file = os.path.join(out, "t", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
if rank == 1:  # rank 1's disk is slow: its optimizer shard lands 3 s late
    save = engine.checkpoint_engine.save
    def slow_save(state_dict, path):
        if "optim_states" in path:
            time.sleep(3)
        save(state_dict, path)
    engine.checkpoint_engine.save = slow_save
seen = {}
if rank == 0:
    def watch():
        while not os.path.exists(os.path.join(out, "latest")):
            time.sleep(0.002)
        seen["rank1_shard_exists_when_latest_appeared"] = os.path.exists(slow_file)
    watcher = threading.Thread(target=watch, daemon=True); watcher.start()
engine.save_checkpoint(out, tag="t")
if rank == 0:
    watcher.join(10)
    print("RESULT " + json.dumps(seen), flush=True)
dist.barrier()
"""


def test_deepspeed_publishes_latest_before_every_rank_has_written(tmp_path: Path) -> None:
    """The race exists: DeepSpeed's ``latest`` names the tag while rank 1's shard is still missing."""
    script = tmp_path / "race.py"
    script.write_text(_RACE_SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--local-addr",
            "127.0.0.1",
            "--nproc-per-node",
            "2",
            str(script),
            str(tmp_path / "ds"),
        ],
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[len("RESULT ") :]) == {"rank1_shard_exists_when_latest_appeared": False}


def test_pipeline_commit_waits_for_the_slow_rank(tmp_path: Path) -> None:
    """The same slow rank under the pipeline: rank 1's files and marker land 3 s late, and ``latest`` (and the
    published step) appear only after rank 1's marker, with every file verified."""
    root = tmp_path / "outputs"
    run_dir = root / "tiny" / "race"
    first_latest: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        latest = run_dir / "checkpoints" / "latest"
        while not stop.is_set() and not first_latest:
            if latest.exists():
                first_latest["time"] = time.time()
                first_latest["step"] = json.loads(latest.read_text())["step"]
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    faults = (
        "shard_save.deepspeed_file@rank=1@action=sleep@seconds=3;shard_save.before_marker@rank=1@action=sleep@seconds=2"
    )
    try:
        proc = run_cli(
            "+experiment=tiny",
            "strategy=deepspeed",
            "strategy.zero_stage=2",
            f"run.root={root}",
            "run.id=race",
            "run.create=true",
            "train.steps=4",  # one save (step 4) is the slow rank's: the first latest is what is checked
            "export=none",  # what is checked is the commit, not the outputs
            env={"PIPELINE_FAULTS": faults},
            timeout=600,
        )
    finally:
        stop.set()
        watcher.join(5)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert first_latest, "latest never appeared"
    committed = run_dir / "checkpoints" / f"step_{first_latest['step']}"
    marker_times = [os.stat(committed / f"rank_{r}.done.json").st_mtime for r in (0, 1)]
    assert first_latest["time"] >= max(marker_times), "latest appeared before rank 1's marker was written"
    assert marker_times[1] - marker_times[0] >= 1.5  # rank 1 really was late (the committer had to wait)
    manifest = json.loads((committed / "manifest.json").read_text())
    assert manifest["format"] == "deepspeed_zero2"
    assert {f["path"] for f in manifest["files"]} >= {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    }
    assert not (run_dir / "checkpoints" / "staging" / "latest").exists()  # DeepSpeed's own latest stays off
