"""``strategy=deepspeed`` compiles and loads no DeepSpeed op: the engine train builds (``zero.build_engine``) with
``strategy.shm_comm=false`` never builds DeepSpeed's CPU shared-memory allreduce op (``deepspeed_shm_comm``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

_ENGINE_SCRIPT = r"""
import sys

from deepspeed.ops.op_builder.builder import OpBuilder

loaded = []


def spy_load(self, *args, **kwargs):
    loaded.append(self.NAME)
    raise RuntimeError(f"DeepSpeed op {self.NAME} was built or loaded")


OpBuilder.load = spy_load  # every builder's load (JIT compile or prebuilt) goes through here

import torch

from pipeline.config.schema import StrategyConfig
from pipeline.strategies import zero
from pipeline.strategies.process_group import init_distributed

strategy = StrategyConfig(name="deepspeed", world_size=1, zero_stage=2, shm_comm=False)
init_distributed(strategy)
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine = zero.build_engine(model, strategy, opt, micro_batch=2, accum=1, clip=None)
loss = engine(torch.randn(2, 8)).square().mean()
engine.backward(loss)
engine.step()
print("ops loaded:", loaded)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_zero_engine_with_shm_comm_off_compiles_and_loads_no_op(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "DS_ACCELERATOR": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _ENGINE_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ops loaded: []" in proc.stdout
    assert list(extensions.iterdir()) == [], "nothing is compiled into TORCH_EXTENSIONS_DIR"
