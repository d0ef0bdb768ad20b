"""A Hugging Face ``Trainer`` run whose checkpoints are committed (docs/trainers.md): a small Llama on synthetic
tokens, ``torchrun --nproc-per-node 2 examples/hf_trainer_train.py --out runs/hf``. Rerun the same command after
a kill: it resumes from the newest committed step. Each rank appends its logged losses to ``<out>/losses.jsonl``
(rank 0) so a resumed run can be compared with an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from pipeline.integrations.hf import CommittedTrainer


class Tokens(torch.utils.data.Dataset):
    """``n`` fixed random sequences (the same on every rank and every run)."""

    def __init__(self, n: int = 512, seq: int = 32, vocab: int = 128, seed: int = 1234) -> None:
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class LogLosses(TrainerCallback):
    def __init__(self, path: str, pause_s: float) -> None:
        self.path, self.pause_s = path, pause_s

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if state.is_world_process_zero and logs:
            logged = {k: logs[k] for k in ("loss", "eval_loss") if k in logs}
            if logged:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"step": state.global_step, **logged}) + "\n")

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(self.pause_s)  # slow enough for a test to kill a rank mid-run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--pause", type=float, default=float(os.environ.get("EXAMPLE_STEP_PAUSE_S", "0")))
    p.add_argument("--best", choices=("min", "max"), help="evaluate at every save and keep the best step too")
    a = p.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=a.out, max_steps=a.steps, save_steps=a.save_steps, save_total_limit=a.keep, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, use_cpu=True, report_to=[], seed=0, disable_tqdm=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        eval_strategy="steps" if a.best else "no", eval_steps=a.save_steps, metric_for_best_model="loss" if a.best
        else None, greater_is_better=a.best == "max" if a.best else None,
    )  # fmt: skip
    callbacks = [LogLosses(os.path.join(a.out, "losses.jsonl"), a.pause)]
    evaluate = Tokens(64, seed=99) if a.best else None
    trainer = CommittedTrainer(
        model=model, args=args, train_dataset=Tokens(), eval_dataset=evaluate, callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=True)  # the newest committed step, or from scratch


if __name__ == "__main__":
    main()
