"""The examples a user copies (``examples/*.py``), launched with ``torchrun`` as a user would, on 2 CPU ranks.

Each is run once uninterrupted (the reference) and once with a rank SIGKILLed mid-run (rank 1 of the DDP
example, rank 0 — which hosts the committer thread — of the FSDP2 one), then relaunched: ``latest`` only ever
names a step that verifies (a watcher checks every value it takes), the relaunch resumes from it with
bit-identical losses, and ``python -m pipeline.status`` / ``pipeline.consolidate`` read the checkpoints, whose
consolidated weights equal the reference run's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.checkpoint.stores.remote import Remote
from pipeline.errors import VerificationError
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.s3 import S3Url
from tests.conftest import ROOT

# every test reads the module's reference runs: one xdist worker runs them all, so the runs are made once
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.xdist_group("examples_references")]

STEPS, EVERY = 24, 4
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _cmd(example: str, out: Path, *extra: str) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        f"examples/{example}",
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        *extra,
    ]


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)$", text, re.M)}


def _run(example: str, out: Path, *extra: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = _cmd(example, out, *extra)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


class LatestWatcher(threading.Thread):
    """Reads ``latest`` over and over; every step it names must verify against its manifest at that moment."""

    def __init__(self, layout: CheckpointLayout) -> None:
        super().__init__(daemon=True)
        self.layout, self.seen, self.bad = layout, set[int](), list[str]()
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                latest = read_latest(self.layout)
                if latest is not None and latest.step not in self.seen:
                    verify_committed(self.layout.committed_step(latest.step), latest.step)
                    self.seen.add(latest.step)
            except FileNotFoundError:
                pass  # a step retention removed after latest moved on (keep_last=3): not what latest names now
            except VerificationError as e:
                if read_latest(self.layout) == latest:  # still named: a real violation, not a race with a commit
                    self.bad.append(str(e))
            time.sleep(0.01)


def _rank_pid(torchrun: psutil.Process, rank: int) -> int:
    for child in torchrun.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} under torchrun {torchrun.pid}")


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[int, str], Path]]:
    """Each example run once, uninterrupted: its losses and its directory."""
    out = {}
    for example in ("ddp_train.py", "fsdp2_train.py"):
        d = tmp_path_factory.mktemp(example.split("_")[0])
        out[example] = (_losses(_run(example, d)), d)
    return out


@pytest.mark.parametrize(("example", "victim"), [("ddp_train.py", 1), ("fsdp2_train.py", 0)])
def test_example_killed_mid_run_resumes_bit_identically(
    example: str, victim: int, references: dict[str, tuple[dict[int, str], Path]], tmp_path: Path
) -> None:
    ref_losses, ref_dir = references[example]
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    out = tmp_path / "run"
    layout = CheckpointLayout(out)
    watcher = LatestWatcher(layout)
    watcher.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        _cmd(example, out, "--sleep", "0.15"), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while (latest := _safe_latest(layout)) < 2 * EVERY:
            assert proc.poll() is None and time.monotonic() < deadline, "the example ended before the kill"
            time.sleep(0.05)
        os.kill(_rank_pid(psutil.Process(proc.pid), victim), signal.SIGKILL)
        first_out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "torchrun should report the killed rank"
    killed_at = _safe_latest(layout)
    assert killed_at >= latest and killed_at < STEPS
    verify_committed(layout.committed_step(killed_at), killed_at)

    second = _run(example, out)
    watcher.halt.set()
    watcher.join(5)
    assert not watcher.bad, watcher.bad
    resumed = _losses(second)
    start = min(resumed) - 1
    assert start >= killed_at, f"resumed from {start}, but step {killed_at} was committed"
    assert resumed == {s: ref_losses[s] for s in range(start + 1, STEPS + 1)}, "losses differ after the resume"
    assert {k: v for k, v in _losses(first_out.decode()).items() if k <= start} == {
        s: ref_losses[s] for s in range(1, start + 1)
    }
    assert read_latest(layout).step == STEPS  # type: ignore[union-attr]

    _the_clis_read_it(out, ref_dir)


def _the_clis_read_it(out: Path, ref_dir: Path) -> None:
    """``pipeline.status``, ``pipeline.consolidate`` and ``pipeline.export`` on the example's checkpoint dir: the
    consolidated weights equal the uninterrupted run's, the export's shards hold exactly them."""
    layout = CheckpointLayout(out)
    for d in (out, ref_dir):
        cmd = [sys.executable, "-m", "pipeline.consolidate", str(d)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
    mine = load_file(layout.consolidated_step(STEPS) / "model.safetensors")
    theirs = load_file(CheckpointLayout(ref_dir).consolidated_step(STEPS) / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)

    cmd = [sys.executable, "-m", "pipeline.export", str(out), "--max-shard-size", "4KB"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    export = layout.export_step(STEPS)
    index = json.loads((export / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    exported = {k: v for s in shards for k, v in load_file(export / s).items()}
    assert len(shards) > 1 and exported.keys() == mine.keys() and all(exported[k].equal(mine[k]) for k in mine)
    status = subprocess.run(  # once, after the export: it shows latest and the export
        [sys.executable, "-m", "pipeline.status", str(out)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert status.returncode == 0 and f"latest: step {STEPS}" in status.stdout, status.stdout + status.stderr
    assert f"exported:     step {STEPS}" in status.stdout, status.stdout


def _safe_latest(layout: CheckpointLayout) -> int:
    try:
        latest = read_latest(layout)
    except (VerificationError, OSError):
        return 0
    return latest.step if latest else 0


def test_example_with_checkpoints_in_a_bucket_resumes_from_it(
    references: dict[str, tuple[dict[int, str], Path]], tmp_path: Path, s3_env: dict[str, str], bucket: str, prefix: str
) -> None:
    """``Checkpointer(..., storage="s3://...")`` (SeaweedFS on loopback): the run stops at step 12, the same
    command continues from the bucket's latest with the uninterrupted run's losses, and the external committer
    CLI reads the same bucket."""
    ref_losses, _ = references["ddp_train.py"]
    out, storage = tmp_path / "run", f"s3://{bucket}/{prefix}"
    first = _losses(_run("ddp_train.py", out, "--storage", storage, "--steps", "12"))
    assert first == {s: ref_losses[s] for s in range(1, 13)}
    remote = Remote(root=S3Url(bucket, prefix), cache_dir=out)
    assert remote.read_latest()[0].step == 12  # type: ignore[union-attr]
    second = _losses(_run("ddp_train.py", out, "--storage", storage))
    assert second == {s: ref_losses[s] for s in range(13, STEPS + 1)}
    assert remote.committed() == [16, 20, 24]  # keep_last=3, applied in the bucket
    assert not list((out / "checkpoints" / "staging").rglob("*.distcp"))  # scratch is gone once uploaded
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.commit", str(out), "--storage", storage],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and "latest = step 24" in done.stdout, done.stdout + done.stderr
    status = subprocess.run(
        [sys.executable, "-m", "pipeline.status", str(out)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert status.returncode == 0 and f"checkpoints: {storage}" in status.stdout, status.stdout + status.stderr
    cons = subprocess.run(  # the dir records its bucket: no --storage needed
        [sys.executable, "-m", "pipeline.consolidate", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert cons.returncode == 0 and "step 24:" in cons.stdout, cons.stdout + cons.stderr
    assert (out / "consolidated" / "step_24" / "model.safetensors").is_file()


def test_a_stateful_dataloader_resumes_mid_epoch_and_shuffles_the_next_epochs_alike(tmp_path: Path) -> None:
    """``examples/loader_train.py``: a shuffled ``StatefulDataLoader`` (6 batches per epoch per rank) saved at step
    10, mid-epoch, resumes with the losses of an uninterrupted run, through the epochs after it too."""
    straight = _losses(_run("loader_train.py", tmp_path / "straight"))
    _run("loader_train.py", tmp_path / "split", "--steps", "10")  # the last flag wins: saves at 4, 8, 10
    resumed = _losses(_run("loader_train.py", tmp_path / "split"))
    assert sorted(resumed) == list(range(11, STEPS + 1)), resumed
    assert resumed == {s: straight[s] for s in resumed}, "the resumed run saw other batches"
