"""A Hugging Face Accelerate loop whose checkpoints are committed (docs/trainers.md): a small MLP on fixed random
data, on 2 CPU processes with either launcher:

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 examples/accelerate_train.py --out runs/acc
    torchrun --nproc-per-node 2 examples/accelerate_train.py --out runs/acc

(``--multi_gpu`` starts them through torch's elastic launcher; ``Accelerator(cpu=True)`` keeps them on the CPU.
``accelerate launch --cpu --num_processes 2`` starts one process, unless ``--mpirun_hostfile`` and ``mpirun``.)
Rerun the same command after a kill: ``load_state(accelerator)`` resumes from the newest committed step, and the
epoch's first batches already trained are skipped with ``accelerator.skip_first_batches`` (with
``--stateful-loader``, Accelerate's ``use_stateful_dataloader=True``, the loader's saved position is restored
instead). Rank 0 appends each step's loss (the mean over the ranks) to ``<out>/losses.jsonl``, so a resumed run
can be compared with an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

from pipeline.integrations.accelerate import close, load_state, save_state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--keep", type=int, default=2, help="ProjectConfiguration's total_limit")
    p.add_argument("--stateful-loader", action="store_true", help="use_stateful_dataloader: its position is saved")
    p.add_argument("--pause", type=float, default=float(os.environ.get("EXAMPLE_STEP_PAUSE_S", "0")))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    config = ProjectConfiguration(project_dir=a.out, automatic_checkpoint_naming=True, total_limit=a.keep)
    # A seedable sampler: each epoch's order comes from data_seed + epoch, so a resume can rebuild it.
    loading = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0, use_stateful_dataloader=a.stateful_loader)
    accelerator = Accelerator(project_config=config, dataloader_config=loading, cpu=True)
    set_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(160, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.3 * torch.randn(160, 1, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)

    step = load_state(accelerator)  # was: accelerator.load_state(); the newest committed step, or 0
    while step < a.steps:
        batches = data  # a stateful loader: load_state restored its position
        if not a.stateful_loader:  # a plain one: the epoch from the step, its batches already trained skipped
            epoch, done = divmod(step, len(data))
            data.set_epoch(epoch)
            batches = accelerator.skip_first_batches(data, done) if done else data
        for xb, yb in batches:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            mean = float(accelerator.reduce(loss.detach(), reduction="mean"))
            if accelerator.is_main_process:
                with open(os.path.join(a.out, "losses.jsonl"), "a") as f:
                    f.write(json.dumps({"step": step, "loss": mean}) + "\n")
            if step % a.every == 0 or step == a.steps:
                save_state(accelerator, step)  # was: accelerator.save_state()
            time.sleep(a.pause)  # slow enough for a test to kill a rank mid-run
            if step == a.steps:
                break
    close(accelerator)  # every staged step committed
    accelerator.end_training()


if __name__ == "__main__":
    main()
