"""Make real DeepSpeed ZeRO checkpoints for tests (CPU, gloo, a ``torchrun`` subprocess with a timeout).

Input: an output dir, the cases to build (ZeRO stage, bf16 or fp32, plain or odd model), world size and steps.
Output per case ``<out_dir>/<case.name>/``:

- ``ckpt/``: the step dir that ``engine.save_checkpoint(<case dir>, tag="ckpt")`` writes;
- ``reference.safetensors``: DeepSpeed's own per-parameter values after training, fetched with
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (every rank calls them, as ZeRO-3 requires),
  named ``fp32/<param>``, ``exp_avg/<param>``, ``exp_avg_sq/<param>`` (trainable params only);
- ``reference.json``: ``{"steps": [Adam step per optimizer state], "names": [...], "frozen": [...]}``.

Models: ``plain`` is a tiny ``LlamaForCausalLM`` (vocab 100, hidden 64, 2 layers, untied embeddings).
``odd`` wraps a Llama with vocab 101 and tied embeddings (a shared param), and adds an odd-sized trainable
param (13 elements), an odd-sized frozen param (11), a persistent float and an int buffer, and two Adam param
groups, so padding, multi-group, frozen, buffer and shared-param paths of ``zero_to_fp32`` are all exercised.

Several cases run in one ``torchrun`` launch (one engine after another in the same process group): each launch
costs several seconds of imports on a small machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TAG = "ckpt"
LAUNCH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ZeroCase:
    stage: int
    bf16: bool = False
    odd: bool = False

    @property
    def name(self) -> str:
        return f"z{self.stage}_{'bf16' if self.bf16 else 'fp32'}{'_odd' if self.odd else ''}"


_SCRIPT = r"""
import json, os, sys
import torch, torch.nn as nn, torch.distributed as dist
import deepspeed
import deepspeed.comm.torch as dct
dct.build_shm_op = lambda: None  # skips a 25 s JIT build of the shared-memory allreduce op (gloo is used)
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from datetime import timedelta

out_dir, world_steps, cases = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
deepspeed.init_distributed(dist_backend="gloo")
rank, ws = dist.get_rank(), dist.get_world_size()


def llama(vocab, tie):
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=tie))


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = llama(101, True)
        self.odd = nn.Parameter(torch.randn(13))
        self.frozen_odd = nn.Parameter(torch.randn(11), requires_grad=False)
        self.register_buffer("scale_buf", torch.randn(3, 5))
        self.register_buffer("index_buf", torch.arange(7))

    def forward(self, input_ids, labels):
        loss = self.lm(input_ids=input_ids, labels=labels).loss
        return loss + 1e-3 * (self.odd.float().sum() * self.frozen_odd.float().sum() + self.scale_buf.float().sum())


for case in cases:
    stage, bf16, odd = case["stage"], case["bf16"], case["odd"]
    torch.manual_seed(0)
    model = Odd() if odd else llama(100, False)
    vocab = 101 if odd else 100
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if odd:
        groups = [{"params": [p for _, p in trainable if p.ndim > 1], "weight_decay": 0.1},
                  {"params": [p for _, p in trainable if p.ndim <= 1], "weight_decay": 0.0}]
    else:
        groups = [{"params": [p for _, p in trainable]}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * ws, "zero_optimization": {"stage": stage},
           "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    for s in range(world_steps):
        x = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(s * 10 + rank))
        out = engine(input_ids=x, labels=x)
        loss = out if torch.is_tensor(out) else out.loss
        engine.backward(loss)
        engine.step()
    case_dir = os.path.join(out_dir, case["name"])
    engine.save_checkpoint(case_dir, tag="ckpt", save_latest=False)
    zo = engine.optimizer
    if getattr(zo, "_hp_optimizer_states_linked", None):
        # DeepSpeed 0.19.8 links the optimizer-state fragments after stepping the first param group only, so
        # safe_get_full_optimizer_state fails for params of later groups; link again now that all have state.
        zo._hp_optimizer_states_linked = False
        zo._lazy_init_hp_params_optimizer_state()
    ref = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        for key in ("fp32", "exp_avg", "exp_avg_sq"):  # collective: every rank calls, in the same order
            t = safe_get_full_fp32_param(p) if key == "fp32" else safe_get_full_optimizer_state(p, key)
            if rank == 0:
                ref[f"{key}/{n}"] = t.detach().float().contiguous().clone()
    if rank == 0:
        save_file(ref, os.path.join(case_dir, "reference.safetensors"))
        steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
        names = [n for n, _ in engine.module.named_parameters()]
        frozen = [n for n, p in engine.module.named_parameters() if not p.requires_grad]
        with open(os.path.join(case_dir, "reference.json"), "w") as f:
            json.dump({"steps": steps, "names": names, "frozen": frozen}, f)
    dist.barrier()
    del engine, model, opt
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_zero_checkpoints(
    out_dir: Path, cases: list[ZeroCase], world: int = 2, steps: int = 2, timeout_s: float = LAUNCH_TIMEOUT_S
) -> dict[ZeroCase, Path]:
    """Train and save every case in one ``torchrun`` launch; return each case's step dir (``<case>/ckpt``).

    Raises RuntimeError with the launch's output when it fails, and ``subprocess.TimeoutExpired`` after
    ``timeout_s`` (the whole process group is killed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    script = out_dir / "_make_zero.py"
    script.write_text(_SCRIPT)
    spec = [{"stage": c.stage, "bf16": c.bf16, "odd": c.odd, "name": c.name} for c in cases]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--local-addr",
        "127.0.0.1",
        f"--nproc-per-node={world}",
        str(script),
        str(out_dir),
        str(steps),
        json.dumps(spec),
    ]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
        "MASTER_PORT": str(_free_port()),
    }
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"DeepSpeed checkpoint launch failed ({proc.returncode}):\n{output[-8000:]}")
    return {c: out_dir / c.name / TAG for c in cases}


def make_zero_checkpoint(
    out_dir: Path, stage: int, bf16: bool, world: int = 2, steps: int = 2, odd: bool = False
) -> Path:
    """One case of :func:`make_zero_checkpoints`: the step dir ``out_dir/<case>/ckpt``."""
    case = ZeroCase(stage, bf16, odd)
    return make_zero_checkpoints(out_dir, [case], world, steps)[case]
