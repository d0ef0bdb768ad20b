"""PyTorch Lightning on the commit protocol (``pipeline.integrations.lightning.CommittedCheckpoint``), as a user
runs it: ``examples/lightning_train.py`` under ``torchrun`` on 2 CPU ranks (gloo, DDP, real ``pytorch_lightning``).

* one uninterrupted run (module fixture) with Lightning's ``AsyncCheckpointIO`` asked for: its saves are
  committed all the same, and ``save_top_k=2, monitor="step", mode="max"`` (Lightning's "the newest k") leaves
  exactly the newest two steps;
* a rank ``kill -9``-ed mid-run, the same command run again (``fit(ckpt_path="last")``): it resumes from the
  newest committed step, mid-epoch, and every loss equals the uninterrupted run's bit for bit; ``latest``, polled
  during the run, only ever names steps that verify; ``save_top_k=2, monitor="train_loss"`` leaves exactly the two
  best steps and the newest; ``status --verify``, ``consolidate`` (the same weights as the uninterrupted run's)
  and ``export`` read what the trainer wrote;
* ``ModelParallelStrategy`` with FSDP2's ``fully_shard`` (2 ranks): each rank saves its own shards of the weights
  and of the optimizer's state; ``fit(ckpt_path=".../checkpoints/step_4")`` resumes that step and logs the same
  losses, bit for bit; ``status --verify`` and ``consolidate`` (full tensors) read the steps;
* ``ckpt_path="best"`` resumes the committed step best by ``monitor``, a step's directory that step, and a step that
  is not committed is refused in one line (before and after anything is committed): one process, five fits;
* why a user would switch: Lightning's own ``ModelCheckpoint`` with ``AsyncCheckpointIO`` removes the previous
  checkpoint as soon as it has queued the new one; killed at that moment it leaves no checkpoint, and the relaunch
  trains from step 0. The committed one killed at the same point resumes from a committed step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pipeline.formats.dcp_metadata import TensorStorageMetadata, read_metadata_safe
from tests.trainer_runs import kill_rank_1_then_rerun, resumed_from, torchrun
from tests.trainer_runs import latest_step as _latest_step
from tests.trainer_runs import losses as _losses
from tests.trainer_runs import run as _run
from tests.trainer_runs import steps as _steps

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.trainers]

EXAMPLE = "examples/lightning_train.py"


def _torchrun(out: Path, *args: str) -> list[str]:
    """The example on 2 ranks: 24 steps (20 an epoch, so saves fall mid-epoch), a save every 4."""
    return torchrun(EXAMPLE, out, *args)


def _verify(out: Path, steps: int) -> None:
    status = subprocess.run(
        [sys.executable, "-m", "pipeline.status", str(out), "--verify"], capture_output=True, text=True, check=False
    )
    assert status.returncode == 0 and f"verify: {steps} of {steps} committed step(s) ok" in status.stdout, status


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run, Lightning's async checkpointing asked for, keeping the newest 2 steps."""
    out = tmp_path_factory.mktemp("lightning") / "whole"
    done = _run(_torchrun(out, "--async-save", "--keep-by", "step"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_async_saves_are_committed_and_the_newest_k_are_kept(whole: Path) -> None:
    assert _latest_step(whole) == 24 and sorted(_losses(whole)) == list(range(1, 25))
    assert _steps(whole) == [20, 24], "save_top_k=2 with monitor='step', mode='max': the newest two steps"
    assert not list((whole / "checkpoints" / "staging").glob("step_*")), "every async save committed at the end"
    _verify(whole, 2)


def test_a_rank_killed_mid_run_resumes_bit_identically_and_every_tool_reads_the_steps(
    whole: Path, tmp_path: Path
) -> None:
    killed = tmp_path / "killed"
    best_k = ("--keep-by", "train_loss")
    done = kill_rank_1_then_rerun(_torchrun(killed, *best_k, "--pause", "0.3"), _torchrun(killed, *best_k), killed)
    assert done.latest_at_kill < 20, "the kill came mid-run"
    assert done.again.returncode == 0, done.again.stderr[-3000:]
    assert 8 <= resumed_from(done.again.stderr) < 20  # mid-epoch: 20 an epoch

    assert _losses(killed) == _losses(whole), "the resumed run's losses differ from the uninterrupted run's"
    assert done.watcher.bad == [] and len(done.watcher.seen) >= 2, (done.watcher.bad, done.watcher.seen)
    losses = _losses(whole)
    saved = [s for s in losses if s % 4 == 0]
    best = sorted(saved, key=lambda s: (losses[s], -s))[:2]  # the lowest two; a tie: the newer step
    assert _steps(killed) == sorted({24, *best}), f"save_top_k=2 by train_loss ({best}), the newest: {_steps(killed)}"

    _verify(killed, len(_steps(killed)))
    for out in (killed, whole):
        done = subprocess.run(
            [sys.executable, "-m", "pipeline.consolidate", str(out)], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
    mine, theirs = (load_file(out / "consolidated" / "step_24" / "model.safetensors") for out in (killed, whole))
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in theirs) and mine
    tool = [sys.executable, "-m", "pipeline.export", str(killed)]
    export = subprocess.run(tool, capture_output=True, text=True, check=False)
    assert export.returncode == 0 and (killed / "export" / "step_24" / "model.safetensors.index.json").is_file()


def test_fsdp2_under_model_parallel_strategy_saves_shards_and_resumes_a_named_step_bit_identically(
    tmp_path: Path,
) -> None:
    out = tmp_path / "fsdp2"
    keep_all = ("--strategy", "fsdp2", "--steps", "12", "--keep", "-1", "--keep-by", "train_loss")
    first = _run(_torchrun(out, *keep_all))
    assert first.returncode == 0, first.stderr[-3000:]
    assert _steps(out) == [4, 8, 12]
    stored = read_metadata_safe(out / "checkpoints" / "step_4").state_dict_metadata
    for key in ("model.net.0.weight", "optim.state.net.0.weight.exp_avg"):
        meta = stored[key]
        assert isinstance(meta, TensorStorageMetadata), key
        assert sorted(tuple(c.offsets) for c in meta.chunks) == [(0, 0), (16, 0)], f"{key}: not one half a rank"
    logged = (out / "losses.jsonl").read_text().splitlines()

    again = _run(_torchrun(out, *keep_all, "--ckpt", str(out / "checkpoints" / "step_4")))
    assert again.returncode == 0, again.stderr[-3000:]
    assert resumed_from(again.stderr) == 4
    rerun = (out / "losses.jsonl").read_text().splitlines()[len(logged) :]
    assert rerun == logged[4:], "steps 5 to 12 after the resume from step 4 differ from the first run's"

    _verify(out, 3)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.consolidate", str(out)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    full = load_file(out / "consolidated" / "step_12" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in full.items()} == {
        "net.0.weight": (32, 8), "net.0.bias": (32,), "net.2.weight": (1, 32), "net.2.bias": (1,)
    }  # fmt: skip


FITS = """
import json, os, runpy, sys
from pathlib import Path
out = Path(sys.argv[1])
main = runpy.run_path("examples/lightning_train.py")["main"]
for i, ckpt in enumerate(sys.argv[2:]):
    print(f"=== fit {i}", file=sys.stderr, flush=True)
    sys.argv = ["lightning_train.py", "--out", str(out), "--steps", "12", "--keep", "-1", "--keep-by", "train_loss",
                "--ckpt", ckpt]
    try:
        main()
    except Exception as e:
        print("refused:", json.dumps(str(e)), file=sys.stderr, flush=True)
    if (out / "losses.jsonl").exists():
        os.replace(out / "losses.jsonl", out / f"losses_{i}.jsonl")
"""


def test_ckpt_path_best_and_a_step_directory_resume_those_committed_steps_and_another_is_refused(
    tmp_path: Path,
) -> None:
    out = tmp_path / "one"

    def step(n: int) -> str:
        return str(out / "checkpoints" / f"step_{n}")

    done = _run([sys.executable, "-c", FITS, str(out), step(4), "last", "best", step(4), step(6)])
    assert done.returncode == 0, done.stderr[-3000:]
    fits = done.stderr.split("=== fit ")[1:]
    assert len(fits) == 5, done.stderr[-3000:]

    def refused(fit: str) -> str:
        lines = [line for line in fit.splitlines() if line.startswith("refused: ")]
        assert len(lines) == 1, fit[-3000:]
        return json.loads(lines[0][len("refused: ") :])

    def logged(i: int) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in map(json.loads, (out / f"losses_{i}.jsonl").read_text().splitlines())}

    assert refused(fits[0]) == (
        f"CommittedCheckpoint: cannot load ckpt_path {step(4)!r}: step 4 is not committed in {out / 'checkpoints'} "
        "(committed: none); pass 'last', 'best' or a committed step"
    )
    first = logged(1)
    assert sorted(first) == list(range(1, 13)) and _steps(out) == [4, 8, 12], "'last' with none committed: fresh"
    best = min((4, 8, 12), key=lambda s: (first[s], -s))  # train_loss, mode="min"; a tie: the newer step
    assert best != 12, f"the data has the newest step best ({first}): 'best' and 'last' would look alike"
    assert resumed_from(fits[2]) == best and logged(2) == {s: first[s] for s in range(best + 1, 13)}
    assert resumed_from(fits[3]) == 4 and logged(3) == {s: first[s] for s in range(5, 13)}
    assert refused(fits[4]) == (
        f"CommittedCheckpoint: cannot load ckpt_path {step(6)!r}: step 6 is not committed in {out / 'checkpoints'} "
        "(committed: 4, 8, 12); pass 'last', 'best' or a committed step"
    )
    assert not (out / "losses_4.jsonl").exists() and _steps(out) == [4, 8, 12], "the refused fit trained nothing"


KILL_AT_ROTATION = """
import os, sys, time
from pathlib import Path
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import ModelCheckpoint
import pipeline.integrations.lightning as integration

write = TorchCheckpointIO.save_checkpoint


def slow_write(self, checkpoint, path, storage_options=None):  # a checkpoint big enough to take a while
    if checkpoint["global_step"] == 8:
        time.sleep(3)
    write(self, checkpoint, path, storage_options)


TorchCheckpointIO.save_checkpoint = slow_write
DIE = bool(os.environ.get("DIE_AT_8"))
OUT = sys.argv[sys.argv.index("--out") + 1]
if os.environ.get("PLAIN"):  # the example on Lightning's own ModelCheckpoint, resumed from its newest file
    remove = ModelCheckpoint._remove_checkpoint

    def remove_then_die(self, trainer, filepath):  # the kill right after the rotation
        remove(self, trainer, filepath)
        if trainer.global_step == 8 and DIE:
            os._exit(9)

    class PlainCheckpoint(ModelCheckpoint):
        def __init__(self, **kwargs):
            kwargs["save_last"] = None  # no last.ckpt: the newest top-k file is the resume point
            super().__init__(**kwargs)

    ModelCheckpoint._remove_checkpoint = remove_then_die
    integration.CommittedCheckpoint = PlainCheckpoint
    import pytorch_lightning as pl

    fit = pl.Trainer.fit

    def fit_from_newest(self, model, data, ckpt_path=None):
        files = sorted(Path(OUT).glob("*.ckpt"), key=os.path.getmtime)
        return fit(self, model, data, ckpt_path=str(files[-1]) if files else None)

    pl.Trainer.fit = fit_from_newest
else:
    commit = integration.CommittedCheckpoint._commit

    def commit_then_die(self, trainer, score):  # the same moment: the step-8 save handed over, nothing more
        commit(self, trainer, score)
        if trainer.global_step == 8 and DIE:
            os._exit(9)

    integration.CommittedCheckpoint._commit = commit_then_die
sys.argv = ["lightning_train.py", *sys.argv[1:]]
import runpy
runpy.run_path("examples/lightning_train.py", run_name="__main__")
"""


def _one_process(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    args = ["--out", str(out), "--steps", "12", "--keep", "1", "--async-save"]
    return _run([sys.executable, "-c", KILL_AT_ROTATION, *args], **env)


def test_lightnings_async_rotation_killed_leaves_nothing_to_resume_and_the_committed_one_resumes(
    tmp_path: Path,
) -> None:
    plain, committed = tmp_path / "plain", tmp_path / "committed"
    assert _one_process(plain, PLAIN="1", DIE_AT_8="1").returncode == 9
    assert list(plain.glob("*.ckpt")) == [], "step 4's file removed, step 8's only queued when the kill came"
    again = _one_process(plain, PLAIN="1")
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [e["step"] for e in map(json.loads, (plain / "losses.jsonl").read_text().splitlines())]
    assert steps[:8] == list(range(1, 9)) and steps[8] == 1, f"the relaunch trained from step 0 again: {steps}"

    assert _one_process(committed, DIE_AT_8="1").returncode == 9
    assert _latest_step(committed) in (0, 4), "step 4 committed (or completely staged: the rerun commits it)"
    again = _one_process(committed)
    assert again.returncode == 0, again.stderr[-3000:]
    assert resumed_from(again.stderr) in (4, 8)
    assert _latest_step(committed) == 12 and _steps(committed) == [12]
