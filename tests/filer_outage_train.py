"""The training script of ``tests/test_filer_outage.py``: a library run (``Checkpointer``, ``committer="external"``)
that trains and saves every ``--every`` steps until the file ``--stop`` exists, then saves its last step and
closes.

    torchrun --standalone --nproc-per-node 2 tests/filer_outage_train.py --out RUN_DIR --events DIR --stop FILE

Each rank appends one JSON line per save to ``DIR/rank<K>.jsonl`` (the step, when the save began and ended on
the wall clock, ``ok`` and the error); rank 0 also writes ``DIR/progress`` (``saving <step>`` before each save)
so the test can take the filer away while a save is in flight, and ``DIR/done`` (the last step) after ``close``.
Every rank logs through ``logging`` with its rank in each line, so the test can count the lines a failed save
cost.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.checkpoint import Checkpointer

MAX_STEPS = 5000
"""A bound for a test that never writes the stop file."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--sleep", type=float, default=0.1, help="seconds each step takes besides its compute")
    p.add_argument("--deadline", type=float, default=90.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    events = Path(args.events)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    ckpt = Checkpointer(
        args.out, every_steps=args.every, committer="external", deadline_s=args.deadline, external_commit_wait_s=60
    )
    start = ckpt.load_latest(into=state)
    step = start
    with open(events / f"rank{rank}.jsonl", "a", buffering=1) as out:
        while step < MAX_STEPS:
            step += 1
            x = torch.randn(16, 8)
            loss = (model(x) - x[:, :4]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.sleep)
            if rank == 0 and os.path.exists(args.stop):
                ckpt.request_preemption()
            stop = ckpt.reached_preemption(step)
            if ckpt.should_save(step) or stop:
                if rank == 0:
                    (events / "progress").write_text(f"saving {step} {time.time():.3f}\n")
                began = time.time()
                result = ckpt.save(step, state, metrics={"loss": loss.item()})
                ended = time.time()
                line = {"step": step, "began": began, "ended": ended, "ok": result.ok, "error": result.error}
                out.write(json.dumps(line) + "\n")
                if rank == 0:
                    (events / "progress").write_text(f"saved {step} {ended:.3f}\n")
            if stop:
                break
    ckpt.close()
    if rank == 0:
        (events / "done").write_text(json.dumps({"start": start, "last": step}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
