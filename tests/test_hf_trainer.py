"""The Hugging Face ``Trainer`` on the commit protocol (``pipeline.integrations.hf.CommittedTrainer``), as a user
runs it: ``examples/hf_trainer_train.py`` under ``torchrun`` on 2 CPU ranks (real ``transformers``).

* a rank ``kill -9``-ed mid-run, the same command run again: it resumes from the newest committed step and its
  logged losses equal an uninterrupted run's bit for bit; ``latest``, polled during the run, only ever names
  steps that verify; ``save_total_limit=2`` with ``metric_for_best_model`` leaves exactly the newest two steps
  and the one with the lowest eval loss; ``status --verify``,
  ``consolidate`` and ``export`` read what the trainer wrote, and the export loads with ``from_pretrained``.
* why a user would switch: the plain ``Trainer`` killed between two files of ``checkpoint-8`` leaves a directory
  that ``resume_from_checkpoint=True`` picks (``get_last_checkpoint``: the highest number, no verification) and
  cannot resume from; the committed trainer killed at the same point resumes from step 4.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.trainer_runs import ENV, kill_rank_1_then_rerun, resumed_from
from tests.trainer_runs import latest_step as _latest_step

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.trainers]

EXAMPLE = "examples/hf_trainer_train.py"


def _torchrun(out: Path, pause_s: float = 0.0) -> list[str]:
    """The example on 2 ranks: 24 steps, a save every 4, save_total_limit=2, evaluated at every save and the
    lowest eval loss kept too (metric_for_best_model)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE,
            "--out", str(out), "--pause", str(pause_s), "--best", "min"]  # fmt: skip


def _losses(out: Path, key: str = "loss") -> dict[int, float]:
    """Step -> the ``key`` rank 0 logged last for it (a resumed run logs the steps after its resume step again)."""
    events = map(json.loads, (out / "losses.jsonl").read_text().splitlines())
    return {e["step"]: e[key] for e in events if key in e}


def test_a_rank_killed_mid_run_resumes_bit_identically_and_every_tool_reads_the_steps(tmp_path: Path) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = subprocess.run(_torchrun(whole), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]

    done = kill_rank_1_then_rerun(_torchrun(killed, pause_s=0.5), _torchrun(killed), killed)
    assert done.again.returncode == 0, done.again.stderr[-3000:]
    assert resumed_from(done.again.stderr) >= 8

    assert _losses(killed) == _losses(whole), "the resumed run's losses differ from the uninterrupted run's"
    assert done.watcher.bad == [] and len(done.watcher.seen) >= 2, (done.watcher.bad, done.watcher.seen)
    evals = _losses(whole, "eval_loss")
    best = min(sorted(evals, reverse=True), key=lambda s: evals[s])  # the lowest; a tie: the newer step
    steps = sorted(int(p.name[5:]) for p in (killed / "checkpoints").glob("step_*"))
    assert steps == sorted({20, 24, best}), f"save_total_limit=2 and the best eval loss (step {best}): {steps}"

    tool = [sys.executable, "-m"]
    status = subprocess.run(
        [*tool, "pipeline.status", str(killed), "--verify"], capture_output=True, text=True, check=False
    )
    assert status.returncode == 0 and f"verify: {len(steps)} of {len(steps)} committed step(s) ok" in status.stdout
    config = str(killed / "checkpoints" / "step_24")
    export = subprocess.run(
        [*tool, "pipeline.export", str(killed), "--config", config], capture_output=True, text=True, check=False
    )
    assert export.returncode == 0, export.stderr
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(killed / "export" / "step_24")).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(str(whole / "checkpoints" / "step_24")).state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)


KILL_AT_RNG = """
import os, sys
import transformers
from transformers import Trainer

real = Trainer._save_rng_state


def save_rng_then_die(self, output_dir):  # a kill between two files of checkpoint-8: its state is never written
    if self.state.global_step == 8 and os.environ.get("DIE_AT_8"):
        os._exit(9)
    real(self, output_dir)


Trainer._save_rng_state = save_rng_then_die
if os.environ.get("PLAIN"):  # the example on the plain Trainer, resumed the way its users do it
    import pipeline.integrations.hf as hf
    from transformers.trainer_utils import get_last_checkpoint

    class PlainTrainer(Trainer):
        def train(self, resume_from_checkpoint=None, **kwargs):
            return super().train(resume_from_checkpoint=get_last_checkpoint(self.args.output_dir), **kwargs)

    hf.CommittedTrainer = PlainTrainer
sys.argv = ["hf_trainer_train.py", *sys.argv[1:]]
import runpy
runpy.run_path("examples/hf_trainer_train.py", run_name="__main__")
"""


def _one_process(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", KILL_AT_RNG, "--out", str(out), "--steps", "12"]
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=300, check=False)


def test_the_plain_trainer_resumes_into_a_half_written_checkpoint_and_the_committed_one_does_not(
    tmp_path: Path,
) -> None:
    plain, committed = tmp_path / "plain", tmp_path / "committed"
    assert _one_process(plain, PLAIN="1", DIE_AT_8="1").returncode == 9
    assert (plain / "checkpoint-8").is_dir() and not (plain / "checkpoint-8" / "trainer_state.json").exists()
    again = _one_process(plain, PLAIN="1")
    assert again.returncode != 0 and "checkpoint-8" in again.stderr, again.stderr[-2000:]

    assert _one_process(committed, DIE_AT_8="1").returncode == 9
    assert _latest_step(committed) in (0, 4) and not (committed / "checkpoints" / "step_8").exists()
    # (step 4 is committed, or completely staged if the kill came before the committer's next pass: the rerun
    # commits it before it decides where to resume)
    again = _one_process(committed)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from committed step 4 " in again.stderr, again.stderr[-3000:]
    assert _latest_step(committed) == 12
