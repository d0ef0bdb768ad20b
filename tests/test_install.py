"""Install into your own environment (README: "Install into your environment"), as a library user does.

A fresh venv that already holds a torch (the user's own: the version this suite runs) gets ``pip install <clone>``,
the core alone. Then: torch is the one that was there, none of Hydra, submitit, DeepSpeed, boto3 or transformers came
along; the README's training script (``examples/readme_train.py``, the README's block verbatim) runs there under
``torchrun`` on 2 ranks, is killed once a step is committed, resumes from it and finishes; ``pipeline.status``
and ``pipeline.export --best`` read what it wrote; the app, whose extra is missing, says which extra in one line.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import ROOT

SCRIPT = ROOT / "examples" / "readme_train.py"
NOT_IN_CORE = ("hydra", "submitit", "deepspeed", "boto3", "transformers", "omegaconf", "peft")


def test_the_readme_script_is_the_readmes_block() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("A complete script (`examples/readme_train.py`):\n\n```python\n", 1)[1].split("```", 1)[0]
    assert SCRIPT.read_text().split('"""\n\n', 1)[1] == block


def _own_torch(venv: Path, where: Path) -> None:
    """Put this suite's torch and what it requires on ``venv``'s path (links in ``where``, named by a ``.pth``), as
    an environment that already holds a torch has it: ``pip install`` then sees it installed (its metadata is there)
    and must keep it. Linking, not installing: unpacking a torch wheel costs a minute of the suite's 2 cores."""
    where.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        dist = importlib.metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if (base / top).exists() and not (where / top).exists():
                (where / top).symlink_to(base / top)
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in dist.requires or [] if "extra ==" not in r]
    site = next((venv / "lib").glob("python3.*/site-packages"))
    (site / "own-torch.pth").write_text(f"{where}\n")


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_core_installs_alone_into_an_environment_with_its_own_torch_and_runs_the_readme(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], tmp_path).returncode == 0
    py, pip = str(venv / "bin" / "python"), [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    version = torch.__version__.split("+")[0]
    _own_torch(venv, tmp_path / "own-torch")  # the user's own torch, there before the project
    done = _run([*pip, str(ROOT)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    probe = "import importlib.util as u, torch; print(torch.__version__); print(*[m for m in %r if u.find_spec(m)])"
    lines = _run([py, "-c", probe % (NOT_IN_CORE,)], tmp_path).stdout.splitlines()
    assert lines[0].split("+")[0] == version, f"torch was replaced: {lines[0]}"
    assert lines[1:] in ([], [""]), f"the core brought {lines[1:]}"

    work = tmp_path / "work"
    (work / "examples").mkdir(parents=True)
    script = work / "examples" / "readme_train.py"
    text = SCRIPT.read_text()  # 400 steps, not 40: 40 train in well under a second, before a kill could land
    assert "rank, steps = dist.get_rank(), 40\n" in text
    script.write_text(text.replace("rank, steps = dist.get_rank(), 40\n", "rank, steps = dist.get_rank(), 400\n"))
    # torchrun's console script is the user's torch install's; the same module, from this venv's python
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    first = subprocess.Popen(torchrun, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)  # fmt: skip
    checkpoints = work / "runs" / "readme" / "checkpoints"
    latest = checkpoints / "latest"
    deadline = time.monotonic() + 300

    def saved() -> bool:  # a step every rank finished (its two done-markers), committed or not yet
        staged = checkpoints.glob("staging/step_*")
        return any(len(list(d.glob("rank_*.done.json"))) == 2 for d in staged) or latest.exists()

    while not saved() and first.poll() is None:
        assert time.monotonic() < deadline, "no step saved in 300 s"
        time.sleep(0.005)
    assert first.poll() is None, f"the job ended before it was killed:\n{first.communicate()[0][-3000:]}"
    tree = [first.pid, *(c.pid for c in psutil.Process(first.pid).children(recursive=True))]
    for pid in tree:  # the whole job at once, mid-run (torchrun's workers run in sessions of their own)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.wait()
    done = _run([*torchrun], work)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    resumed = re.search(r"resumed from step (\d+) ", done.stderr)
    assert resumed and 0 < int(resumed.group(1)) < 400, done.stderr[-3000:]  # a step saved before the kill
    assert '"step": 400' in latest.read_text() and "committed step 400" in done.stderr, done.stderr[-3000:]

    status = _run([py, "-m", "pipeline.status", "runs/readme"], work)
    assert status.returncode == 0 and "latest" in status.stdout, status.stdout + status.stderr
    export = _run([py, "-m", "pipeline.export", "runs/readme", "--best"], work)
    assert export.returncode == 0 and export.stdout.startswith("step "), export.stdout + export.stderr
    app = _run([py, "-m", "pipeline", "+experiment=tiny"], work)
    lines = app.stderr.strip().splitlines()
    assert app.returncode == 2 and len(lines) == 1, app.stderr
    assert re.fullmatch(r"error: the app \(python -m pipeline\) needs \w+, which is not installed: "
                        r"pip install 'race-free-ckpt\[app\]'", lines[0]), lines[0]  # fmt: skip
