"""Make real DeepSpeed ZeRO checkpoints for tests (CPU, gloo, a ``torchrun`` subprocess with a timeout).

Input: an output dir, the cases to build (ZeRO stage, bf16 or fp32, plain or odd model), world size and steps.
Output per case ``<out_dir>/<case.name>/``:

- ``ckpt/``: the step dir that ``engine.save_checkpoint(<case dir>, tag="ckpt")`` writes;
- ``reference.safetensors``: DeepSpeed's own per-parameter values after training, fetched with
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (every rank calls them, as ZeRO-3 requires),
  named ``fp32/<param>``, ``exp_avg/<param>``, ``exp_avg_sq/<param>`` (trainable params only);
- ``reference.json``: ``{"steps": [Adam step per optimizer state], "names": [...], "frozen": [...],
  "ds_ids": [ZeRO-3: each flat fp32 sub-group's "<first>_<last>" ds_id]}``.

Models: ``plain`` is a tiny ``LlamaForCausalLM`` (vocab 100, hidden 64, 2 layers, untied embeddings).
``odd`` wraps a Llama with vocab 101 and tied embeddings (a shared param), and adds an odd-sized trainable
param (13 elements), an odd-sized frozen param (11), a persistent float and an int buffer, and two Adam param
groups, so padding, multi-group, frozen, buffer and shared-param paths of ``zero_to_fp32`` are all exercised.

``big`` (ZeRO-3) makes the Llama large enough for NVMe swapping; ``nvme`` really offloads params and optimizer
state to NVMe (``<case>_swap/rank_K``, needs libaio and DeepSpeed's async_io op): that is how a real
NVMe-offloaded checkpoint is made. :func:`nvme_layout_from` turns a plain ``big`` ZeRO-3 step into the same
on-disk layout without libaio.

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
BIG_SUB_GROUP = 300_000


@dataclass(frozen=True)
class ZeroCase:
    stage: int
    bf16: bool = False
    odd: bool = False
    big: bool = False
    """A Llama large enough (hidden 256, vocab 2048/2049, ~2.3 M params) for NVMe swapping, in ZeRO-3 sub-groups
    of at most ``BIG_SUB_GROUP`` elements per rank: with 2 ranks and ``odd``, sub-groups 0 and 1 hold at least
    1 MiB of fp32 per rank (DeepSpeed swaps them), sub-groups 2 and 3 less (DeepSpeed keeps them in memory)."""
    nvme: bool = False
    """ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on NVMe (needs libaio and the async_io op)."""

    @property
    def name(self) -> str:
        size = "_big" if self.big else ""
        return f"z{self.stage}_{'bf16' if self.bf16 else 'fp32'}{'_odd' if self.odd else ''}{size}" + (
            "_nvme" if self.nvme else ""
        )


_SCRIPT = r"""
import json, os, sys
import torch, torch.nn as nn, torch.distributed as dist
import deepspeed
from pipeline.strategies.zero import disable_shm_comm_op
disable_shm_comm_op()  # no 25 s JIT build of the shared-memory allreduce op (gloo is used)
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from datetime import timedelta

out_dir, world_steps, cases = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
BIG_SUB_GROUP = int(os.environ["DS_HELPERS_SUB_GROUP"])
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
deepspeed.init_distributed(dist_backend="gloo")
rank, ws = dist.get_rank(), dist.get_world_size()


def llama(vocab, tie, big=False):
    hidden, inter = (256, 512) if big else (64, 128)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, tie_word_embeddings=tie))


class Odd(nn.Module):
    def __init__(self, big):
        super().__init__()
        self.lm = llama(2049 if big else 101, True, big)
        self.odd = nn.Parameter(torch.randn(13))
        self.frozen_odd = nn.Parameter(torch.randn(11), requires_grad=False)
        self.register_buffer("scale_buf", torch.randn(3, 5))
        self.register_buffer("index_buf", torch.arange(7))

    def forward(self, input_ids, labels):
        loss = self.lm(input_ids=input_ids, labels=labels).loss
        return loss + 1e-3 * (self.odd.float().sum() * self.frozen_odd.float().sum() + self.scale_buf.float().sum())


for case in cases:
    stage, bf16, odd, big, nvme = case["stage"], case["bf16"], case["odd"], case["big"], case["nvme"]
    torch.manual_seed(0)
    model = Odd(big) if odd else llama(2048 if big else 100, False, big)
    vocab = (2049 if big else 101) if odd else (2048 if big else 100)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if odd:
        groups = [{"params": [p for _, p in trainable if p.ndim > 1], "weight_decay": 0.1},
                  {"params": [p for _, p in trainable if p.ndim <= 1], "weight_decay": 0.0}]
    else:
        groups = [{"params": [p for _, p in trainable]}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    zero = {"stage": stage}
    if big:
        zero["sub_group_size"] = BIG_SUB_GROUP
    if nvme:  # each rank swaps under its own dir (as the pipeline's strategy.nvme_path does)
        swap = {"device": "nvme", "nvme_path": os.path.join(out_dir, case["name"] + "_swap", f"rank_{rank}")}
        zero["offload_optimizer"] = dict(swap)
        zero["offload_param"] = dict(swap, buffer_size=2_000_000)  # 5 x 8 MB swap buffers, not 5 x 400 MB
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * ws, "zero_optimization": zero,
           "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if nvme:  # the client torch AdamW also with offload (no DeepSpeedCPUAdam build)
        cfg.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
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
        ds_ids = [str(getattr(t, "ds_id", "")) for t in getattr(zo, "fp32_partitioned_groups_flat", [])]
        with open(os.path.join(case_dir, "reference.json"), "w") as f:
            json.dump({"steps": steps, "names": names, "frozen": frozen, "ds_ids": ds_ids}, f)
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
    spec = [
        {"stage": c.stage, "bf16": c.bf16, "odd": c.odd, "big": c.big, "nvme": c.nvme, "name": c.name} for c in cases
    ]
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
        "DS_HELPERS_SUB_GROUP": str(BIG_SUB_GROUP),
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


# --------------------------------------------------------------------------------------- NVMe offload layout

SWAP_MIN_BYTES = 1 << 20
"""DeepSpeed swaps a ZeRO-3 sub-group to NVMe when its per-rank fp32 partition holds at least this many bytes
(``OptimizerSwapper.is_swappable_tensor``: ``max(MIN_AIO_BYTES, aio.block_size)``, 1 MiB by default)."""
SWAP_ALIGN_NUMEL = 256
"""DeepSpeed writes a swap file padded to a multiple of ``1024 * aio.intra_op_parallelism`` bytes (256 fp32)."""
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


def nvme_layout_from(src_step: Path, dst_step: Path, pad_byte: int = 0xFF) -> dict[int, list[str]]:
    """Rewrite a plain (not offloaded) ZeRO-3 step dir into the layout that ``offload_optimizer.device=nvme``
    gives with DeepSpeed 0.19.8; return each rank's swap files (relative to ``dst_step``).

    Mirrors a real NVMe save (``tests/test_deepspeed_nvme.py`` compares the two when a real one can be made):
    every sub-group whose per-rank fp32 partition holds at least :data:`SWAP_MIN_BYTES` is swapped:

    * its fp32 partition goes to ``offloaded_tensors/rank<NN>/<ds_id>.tensor.swp`` and each Adam state to
      ``<key>-<ds_id>.tensor.swp`` (``ds_id``: the ``"<first>_<last>"`` that DeepSpeed stores on the flat tensor,
      kept by ``torch.save``), as raw elements padded to :data:`SWAP_ALIGN_NUMEL` elements (DeepSpeed leaves
      whatever its swap buffer held; ``pad_byte`` fills the padding here, so a reader that uses it shows);
    * in the optimizer-state file the flat fp32 tensor and the Adam states become EMPTY float32 tensors (the
      ``ds_id`` attribute stays: ``<ds_id>`` and ``<key>-<ds_id>``); the scalar ``step`` stays.

    Smaller sub-groups stay in the optimizer-state file untouched; the model-state files are copied as they are.
    """
    import shutil

    import torch

    shutil.copytree(src_step, dst_step)
    swapped: dict[int, list[str]] = {}
    for optim in sorted(dst_step.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")):
        rank = int(optim.name.split("zero_pp_rank_")[1].split("_")[0])
        sd = torch.load(optim, map_location="cpu", weights_only=False)
        osd = sd["optimizer_state_dict"]
        base = osd["optimizer_state_dict"]
        flat_index = [idx for g in base["param_groups"] for idx in g["params"]]
        rel_dir = f"offloaded_tensors/rank{rank:02d}"
        (dst_step / rel_dir).mkdir(parents=True)
        swapped[rank] = []
        for i, fp32 in enumerate(osd["fp32_flat_groups"]):
            if fp32.numel() * fp32.element_size() < SWAP_MIN_BYTES:
                continue
            ds_id = fp32.ds_id
            state = base["state"].get(flat_index[i], {})
            for key, tensor in [("fp32", fp32)] + [(k, state[k]) for k in OPTIM_KEYS if k in state]:
                name = f"{ds_id}.tensor.swp" if key == "fp32" else f"{key}-{ds_id}.tensor.swp"
                data = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
                pad = (-tensor.numel()) % SWAP_ALIGN_NUMEL * tensor.element_size()
                (dst_step / rel_dir / name).write_bytes(data + bytes([pad_byte]) * pad)
                swapped[rank].append(f"{rel_dir}/{name}")
                empty = torch.empty(0, dtype=tensor.dtype)
                empty.ds_id = ds_id if key == "fp32" else f"{key}-{ds_id}"  # type: ignore[attr-defined]
                if key == "fp32":
                    empty.requires_grad = True
                    osd["fp32_flat_groups"][i] = empty
                else:
                    state[key] = empty
        torch.save(sd, optim)
    return swapped
