"""Hugging Face Accelerate on the commit protocol (``pipeline.integrations.accelerate``: ``save_state`` /
``load_state``), as a user runs it: ``examples/accelerate_train.py`` under ``torchrun`` on 2 CPU ranks (gloo, DDP,
the real ``accelerate``).

* one uninterrupted run (module fixture), started with ``accelerate launch --multi_gpu --num_processes 2`` (it
  runs CPU ranks too): 2 ranks, and ``total_limit=2`` leaves exactly the newest two committed steps;
* a rank ``kill -9``-ed mid-run, the same command run again (``load_state(accelerator)``): it resumes from the
  newest committed step, mid-epoch (20 steps an epoch), and every loss equals the uninterrupted run's bit for bit;
  ``latest``, polled during the run, only ever names steps that verify; ``total_limit`` leaves exactly the two
  newest; ``status --verify``, ``consolidate`` (the same weights as the uninterrupted run's) and ``export`` read
  what was written;
* a stateful loader (``use_stateful_dataloader=True``) resumes from the position the step saved, mid-epoch, into
  the next epoch, with the same losses as an uninterrupted run;
* why a user would switch: Accelerate's own ``save_state`` with ``total_limit=1`` ``rmtree``-s ``checkpoint_0``
  before it writes ``checkpoint_1``; killed mid-write, it leaves one torn checkpoint, and the relaunch's
  ``load_state()`` picks it and fails. The committed one killed at the same point resumes from step 4, even while
  the rerun's committer is between the two acts of step 4's commit (its rename and its manifest).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pipeline.storage.faults import CRASH_EXIT_CODE
from tests.trainer_runs import kill_rank_1_then_rerun, torchrun
from tests.trainer_runs import latest_step as _latest_step
from tests.trainer_runs import losses as _losses
from tests.trainer_runs import resumed_from as _resumed_from
from tests.trainer_runs import run as _run
from tests.trainer_runs import steps as _steps

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.trainers]

EXAMPLE = "examples/accelerate_train.py"


def _torchrun(out: Path, *args: str) -> list[str]:
    """The example on 2 ranks: 24 steps (20 an epoch, so saves fall mid-epoch), a save every 4, total_limit=2."""
    return torchrun(EXAMPLE, out, *args)


def _accelerate_launch(out: Path, *args: str) -> list[str]:
    """The example on 2 CPU processes as Accelerate's users start it (``accelerate launch``, no config file)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", EXAMPLE,
            "--out", str(out), *args]  # fmt: skip


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run, started with ``accelerate launch`` (the killed run's losses, under torchrun, must
    equal its own: the two launchers run the same 2 ranks)."""
    out = tmp_path_factory.mktemp("accelerate") / "whole"
    done = _run(_accelerate_launch(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_an_uninterrupted_run_commits_and_total_limit_keeps_the_newest_two(whole: Path) -> None:
    assert _latest_step(whole) == 24 and sorted(_losses(whole)) == list(range(1, 25))
    manifest = json.loads((whole / "checkpoints" / "step_24" / "manifest.json").read_text())
    assert manifest["world_size"] == 2, "accelerate launch started 2 processes"
    assert _steps(whole) == [20, 24], "total_limit=2: the newest two committed steps"
    assert not list((whole / "checkpoints").glob("checkpoint_*")), "Accelerate's own save_state never ran"


def test_a_rank_killed_mid_run_resumes_bit_identically_and_every_tool_reads_the_steps(
    whole: Path, tmp_path: Path
) -> None:
    killed = tmp_path / "killed"
    done = kill_rank_1_then_rerun(_torchrun(killed, "--pause", "0.3"), _torchrun(killed), killed)
    assert done.latest_at_kill < 20, "the kill came mid-run"
    assert done.again.returncode == 0, done.again.stderr[-3000:]
    assert 8 <= _resumed_from(done.again.stderr) < 20  # mid-epoch: 20 steps an epoch

    assert _losses(killed) == _losses(whole), "the resumed run's losses differ from the uninterrupted run's"
    assert done.watcher.bad == [] and len(done.watcher.seen) >= 2, (done.watcher.bad, done.watcher.seen)
    assert _steps(killed) == [20, 24], "total_limit=2: exactly the newest two committed steps"

    status = subprocess.run(
        [sys.executable, "-m", "pipeline.status", str(killed), "--verify"], capture_output=True, text=True, check=False
    )
    assert status.returncode == 0 and "verify: 2 of 2 committed step(s) ok" in status.stdout, status
    for out in (killed, whole):
        done = subprocess.run(
            [sys.executable, "-m", "pipeline.consolidate", str(out)], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
    mine, theirs = (load_file(out / "consolidated" / "step_24" / "model.safetensors") for out in (killed, whole))
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in theirs) and mine
    export = subprocess.run(
        [sys.executable, "-m", "pipeline.export", str(killed)], capture_output=True, text=True, check=False
    )
    assert export.returncode == 0 and (killed / "export" / "step_24" / "model.safetensors.index.json").is_file()


def test_a_stateful_loader_resumes_mid_epoch_from_its_committed_position(tmp_path: Path) -> None:
    """One process (40 batches an epoch): stopped at step 12, relaunched to 44; its losses equal a run of 44."""
    stopped, through = tmp_path / "stopped", tmp_path / "through"
    for out, steps in ((through, "44"), (stopped, "12"), (stopped, "44")):
        done = _run([sys.executable, EXAMPLE, "--out", str(out), "--steps", steps, "--stateful-loader"])
        assert done.returncode == 0, done.stderr[-3000:]
    assert _resumed_from(done.stderr) == 12
    assert _losses(stopped) == _losses(through) and sorted(_losses(through)) == list(range(1, 45))


TWO_MODELS = """
import json, random, sys
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from pipeline.integrations.accelerate import close, load_state, save_state


class Counter:  # an object given to register_for_checkpointing
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = int(sd["n"])


phase, out = sys.argv[1], sys.argv[2]
config = ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True)
acc = Accelerator(cpu=True, project_config=config)
torch.manual_seed(0)
gen, dis = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
opt_d = torch.optim.SGD(dis.parameters(), lr=0.1, momentum=0.9)  # prepared first: its model is not the first
opt_g = torch.optim.Adam(gen.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.5)
counter = Counter()
acc.register_for_checkpointing(counter)
gen, dis, opt_d, opt_g, sched = acc.prepare(gen, dis, opt_d, opt_g, sched)


def train(steps):
    seen = []
    for _ in range(steps):
        x = torch.randn(8, 4) + random.random() + float(np.random.rand())  # every generator Accelerate saves
        loss = dis(gen(x)).pow(2).mean()
        acc.backward(loss)
        opt_g.step(); opt_d.step(); sched.step(); opt_g.zero_grad(); opt_d.zero_grad()
        counter.n += 1
        seen.append(loss.item())
    return seen


if phase == "first":
    train(3)
    assert save_state(acc).ok and config.iteration == 1  # automatic naming: step 1, Accelerate's first save
    after = train(2)
else:
    assert load_state(acc) == 1 and counter.n == 3 and config.iteration == 1
    after = train(2)
    assert save_state(acc).ok and config.iteration == 2, "the numbering goes on after the load: step 2"
close(acc)
print(json.dumps(after))
"""


def test_every_model_optimizer_scheduler_object_and_generator_of_the_accelerator_resumes(tmp_path: Path) -> None:
    """Two prepared models, two optimizers (the first one prepared steps the second model), a scheduler, a
    registered object, torch's, Python's and NumPy's generators: the steps after the load equal those after the
    save."""
    first = _run([sys.executable, "-c", TWO_MODELS, "first", str(tmp_path)])
    assert first.returncode == 0, first.stderr[-3000:]
    again = _run([sys.executable, "-c", TWO_MODELS, "again", str(tmp_path)])
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.splitlines()[-1]) == json.loads(first.stdout.splitlines()[-1])
    assert _steps(tmp_path) == [1, 2] and _latest_step(tmp_path) == 2


REFUSALS = """
import sys
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from pipeline.errors import ConfigError
from pipeline.integrations.accelerate import close, load_state, save_state

for call in (lambda: load_state(Accelerator(cpu=True)),
             lambda: save_state(Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=sys.argv[1])))):
    try:
        call()
        print("no error")
    except ConfigError as e:
        print(e)
acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=sys.argv[1]))
load_state(acc, checkpointer={"deadline_s": 60})
try:
    save_state(acc, 1, checkpointer={"deadline_s": 30})
except ConfigError as e:
    print(e)
close(acc)
"""


def test_what_cannot_be_saved_as_asked_is_one_line_saying_what_to_pass(tmp_path: Path) -> None:
    done = _run([sys.executable, "-c", REFUSALS, str(tmp_path / "run")])
    assert done.returncode == 0, done.stderr[-3000:]
    no_dir, no_step, options = done.stdout.splitlines()
    assert "has no project_dir: pass project_config=ProjectConfiguration(project_dir=" in no_dir, no_dir
    assert "pass the step" in no_step and "automatic_checkpoint_naming=True" in no_step, no_step
    assert "is open with {'deadline_s': 60}" in options and "at the first save_state/load_state" in options, options
    assert not (tmp_path / "run" / "checkpoints" / "staging" / "step_1").exists(), "nothing saved by a refusal"


KILL_MID_SAVE = """
import os, sys
from pathlib import Path
import pipeline.integrations.accelerate as integration

if os.environ.get("PLAIN"):  # the example on Accelerate's own save_state / load_state
    import accelerate.checkpointing as checkpointing

    write = checkpointing.save

    def write_then_die(obj, f, *args, **kwargs):  # the kill mid-save: checkpoint_1's weights written, not the rest
        if Path(f).parent.name == "checkpoint_1" and Path(f).name.startswith("optimizer") and os.environ.get("DIE"):
            os._exit(9)
        return write(obj, f, *args, **kwargs)

    checkpointing.save = write_then_die
    EVERY = int(sys.argv[sys.argv.index("--every") + 1])

    def plain_load(accelerator, step="latest", **_):  # what an Accelerate script does: the highest checkpoint_N
        where = Path(accelerator.project_dir) / "checkpoints"
        if not where.is_dir() or not os.listdir(where):
            return 0
        accelerator.load_state()
        newest = max(int(p.name.split("_")[1]) for p in where.iterdir())
        accelerator.project_configuration.iteration = newest + 1
        return EVERY * (newest + 1)

    integration.save_state = lambda accelerator, step=None, **_: accelerator.save_state()
    integration.load_state = plain_load
    integration.close = lambda accelerator: None
sys.argv = ["accelerate_train.py", *sys.argv[1:]]
import runpy
runpy.run_path("examples/accelerate_train.py", run_name="__main__")
"""


def _one_process(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    args = ["--out", str(out), "--steps", "12", "--every", "4", "--keep", "1"]
    return _run([sys.executable, "-c", KILL_MID_SAVE, *args], **env)


def test_accelerates_rotation_killed_mid_save_leaves_a_torn_checkpoint_and_the_committed_one_resumes(
    tmp_path: Path,
) -> None:
    plain, committed = tmp_path / "plain", tmp_path / "committed"
    assert _one_process(plain, PLAIN="1", DIE="1").returncode == 9
    left = sorted(p.name for p in (plain / "checkpoints").iterdir())
    assert left == ["checkpoint_1"], f"checkpoint_0 rmtree-d by the rotation before checkpoint_1 was written: {left}"
    assert not (plain / "checkpoints" / "checkpoint_1" / "optimizer.bin").exists()
    again = _one_process(plain, PLAIN="1")
    assert again.returncode != 0 and "optimizer.bin" in again.stderr, "load_state() picked the torn checkpoint_1"

    faults = {"PIPELINE_FAULTS": "shard_save.before_marker@step=8@action=exit"}  # step 8's files written, no marker
    assert _one_process(committed, **faults).returncode == CRASH_EXIT_CODE
    assert _latest_step(committed) in (0, 4), "step 4 committed (or completely staged: the rerun commits it)"
    # The rerun's committer commits step 4 while load_state decides: held between its rename and its manifest (a
    # window a loaded CI machine opens by chance), the decision waits for it, never starts fresh.
    again = _one_process(committed, PIPELINE_FAULTS="verify.before_manifest@step=4@action=sleep@seconds=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _resumed_from(again.stderr) == 4, "step 8 was never complete: the last committed step is 4"
    assert _latest_step(committed) == 12 and _steps(committed) == [12], "total_limit=1"
