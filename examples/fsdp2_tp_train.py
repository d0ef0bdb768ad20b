"""A 2-D parallel training script (FSDP2 over "dp", tensor parallel over "tp") with checkpoints from the library.

    torchrun --standalone --nproc-per-node 4 examples/fsdp2_tp_train.py --out runs/2d --dp 2 --tp 2
    python -m pipeline.status runs/2d --verify
    python -m pipeline.consolidate runs/2d        # the 2-D shards joined into full tensors
    torchrun --standalone --nproc-per-node 2 examples/fsdp2_tp_train.py --out runs/2d --dp 1 --tp 2 --steps 60

The model is laid out as torch's ``parallelize_module`` does it (attention heads and the MLP's hidden units split
column-wise then row-wise over "tp"), then ``fully_shard`` over "dp" of a ``(dp, tp)`` device mesh: every
parameter is a DTensor on both mesh dimensions. Each rank saves only its own shards (DCP); a step resumes at the
same degrees bit-identically and at other ``--dp``/``--tp`` degrees (DCP reshards each tensor by its global
shape). The data is one global batch per step, split over "dp", so the losses do not depend on the degrees
(up to the collectives' rounding). The lines marked ``# ckpt`` are all that checkpointing adds.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pipeline.checkpoint import Checkpointer  # ckpt


class Block(torch.nn.Module):
    """Causal self-attention then an MLP, both residual; heads and hidden units are what "tp" splits."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.o = torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class TinyLM(torch.nn.Module):
    """The user's own model: embeddings, residual blocks, an output head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def parallelize(model: TinyLM, dp: int, tp: int) -> None:
    """Tensor parallel over "tp" (every parameter a DTensor, so one optimizer step sees one mesh), then FSDP2
    over "dp": the layout torchtitan gives a transformer, on CPU ranks."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        plan |= {f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "up")}
        plan |= {f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "down")}
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


class Tokens:
    """The user's own loader: one global batch per step (a counting pattern), each "dp" rank taking its rows."""

    def __init__(self, dp_rank: int, dp: int, batch: int = 8, seq: int = 16, vocab: int = 64) -> None:
        if batch % dp:
            raise SystemExit(f"error: --dp {dp} does not divide the global batch of {batch}: pick a divisor")
        self.rows = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
        self.batch, self.seq, self.vocab, self.pos = batch, seq, vocab, 0

    def __next__(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.pos)
        self.pos += 1
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=g)
        return ((start + torch.arange(self.seq + 1)) % self.vocab)[self.rows]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}  # the same on every rank: the step's position in the global stream

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = int(sd["pos"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint directory (created)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel (FSDP2) degree")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides the 4 heads)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="save every N steps")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to watch or kill it)")
    p.add_argument("--fast-every", type=int, default=None, help="also keep a fast copy every N steps (node-local)")
    p.add_argument("--fast-dir", default=None, help="node-local dir of the fast tier ({rank} is filled in)")
    p.add_argument("--full-params", help="at the end, rank 0 writes the full parameters here (safetensors)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.dp * args.tp != world:
        raise SystemExit(f"error: --dp {args.dp} x --tp {args.tp} is not the {world} ranks: launch dp*tp ranks")
    if 4 % args.tp:
        raise SystemExit(f"error: --tp {args.tp} does not divide the model's 4 attention heads: use 1, 2 or 4")
    torch.manual_seed(0)
    model = TinyLM()
    parallelize(model, args.dp, args.tp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = Tokens(rank // args.tp, args.dp)

    fast_dir = args.fast_dir.format(rank=rank) if args.fast_dir else None
    ckpt = Checkpointer(args.out, every_steps=args.every, keep_last=3,  # ckpt
                        fast_every=args.fast_every, fast_dir=fast_dir)  # fmt: skip  # ckpt
    state = {"model": model, "optim": opt, "data": data}  # ckpt
    start = ckpt.load_latest(into=state)  # ckpt
    for step in range(start + 1, args.steps + 1):
        ids = next(data)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # each "tp" group holds one loss: the mean over all ranks is the mean over "dp"
        if rank == 0:
            print(f"step {step} loss {total.item() / world!r}", flush=True)
        time.sleep(args.sleep)
        stop = ckpt.reached_preemption(step)  # ckpt
        if ckpt.should_save(step) or step == args.steps or stop:  # ckpt
            ckpt.save(step, state)  # ckpt
        if ckpt.should_save_fast(step):  # ckpt: a copy of this rank's shards, restored only at the same layout
            ckpt.save_fast(step, state)  # ckpt
        if stop:  # ckpt
            break  # ckpt
    ckpt.close()  # ckpt
    if args.full_params:
        full = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in model.state_dict().items()}
        if rank == 0:
            save_file({n: t.contiguous() for n, t in full.items()}, args.full_params)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
