"""Resume anywhere: one run continued at another world size (2 -> 4 -> 1) and under another strategy
(ZeRO-3 -> FSDP2 -> ZeRO-1), through the world-size-free form, against uninterrupted runs.

With ``train.global_batch_size`` fixed, the training arithmetic does not depend on the world size: each step
sees the same global batch and the loss (logged as the global mean) is the same function of the weights. The
continued run's losses therefore match the uninterrupted run's within float32 reduction-order noise (observed
<= 1e-6; the tolerance is 1e-5 relative). DeepSpeed itself refuses both changes.

Both tests compare with one uninterrupted reference, made once for the module (``reference``): DDP on 1 rank, the
cheapest run, since neither the world size nor the strategy changes the losses beyond that noise.

Every launch consolidates its step (any committed format, read back); none exports (``export=none``): the export
reads only the consolidated file, whatever the strategy, and is tested end to end in test_pipeline_e2e.py,
test_byo.py and test_deepspeed_pipeline.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.checkpoint.manifest import read_manifest
from pipeline.storage.layout import RunLayout
from tests.conftest import run_cli

# the tests share the module's reference run: one xdist worker runs them both, so it is made once
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.xdist_group("resume_anywhere_reference")]

COMMON = ("+experiment=tiny", "train.steps=12", "train.global_batch_size=8", "checkpoint.every=4", "export=none")
RTOL = 1e-5


def _launch(root: Path, *args: str) -> str:
    proc = run_cli(f"run.root={root}", *args, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _losses(root: Path, run_id: str) -> dict[int, float]:
    """The newest loss logged for each step (metrics.jsonl, rank 0's record of the global mean)."""
    out: dict[int, float] = {}
    for line in (root / "tiny" / run_id / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "step":
            out[int(event["step"])] = float(event["loss"])
    return out


def _close(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    bad = {s: (got[s], want[s]) for s in steps if abs(got[s] - want[s]) > RTOL * abs(want[s])}
    assert not bad, f"losses differ beyond rtol {RTOL}: {bad}"


def _resume_events(root: Path, run_id: str) -> list[dict[str, object]]:
    lines = (root / "tiny" / run_id / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "resume"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of one uninterrupted run (DDP, 1 rank: the cheapest). At a fixed global batch they depend on
    neither the world size nor the strategy beyond reduction noise, so every piece (2, 4 and 1 ranks; ZeRO-1/2/3
    and FSDP2) is compared with them."""
    root = tmp_path_factory.mktemp("reference")
    _launch(root, *COMMON, "strategy=ddp", "strategy.world_size=1", "run.id=full", "run.create=true")
    return _losses(root, "full")


def test_world_size_2_to_4_to_1(tmp_path: Path, reference: dict[int, float]) -> None:
    zero2 = ("strategy=deepspeed", "strategy.zero_stage=2")
    _launch(tmp_path, *COMMON, *zero2, "run.id=piece", "run.create=true", "train.stop_after_step=4")
    out = _launch(tmp_path, "run.id=piece", "strategy.world_size=4", "train.stop_after_step=8")
    assert "continues with strategy.world_size 2 -> 4" in out
    _launch(tmp_path, "run.id=piece", "strategy.world_size=1")

    piece = _losses(tmp_path, "piece")
    _close(piece, reference, range(1, 13))

    layout = RunLayout.for_run(tmp_path, "tiny", "piece")
    worlds = {s: read_manifest(layout.committed_step(s)).world_size for s in (4, 8, 12)}
    assert worlds == {4: 2, 8: 4, 12: 1}
    assert [(e["from_world_size"], e["to_world_size"]) for e in _resume_events(tmp_path, "piece")] == [(2, 4), (4, 1)]
    history = yaml.safe_load(layout.run_yaml.read_text())["history"]
    assert [h["changes"]["strategy.world_size"] for h in history] == [[2, 4], [4, 1]]


def test_zero3_to_fsdp2_to_zero1(tmp_path: Path, reference: dict[int, float]) -> None:
    _launch(
        tmp_path,
        *COMMON,
        "strategy=deepspeed",
        "strategy.zero_stage=3",
        "run.id=piece",
        "run.create=true",
        "train.stop_after_step=4",
    )
    out = _launch(tmp_path, "run.id=piece", "strategy=fsdp2", "train.stop_after_step=8")
    assert "strategy.name deepspeed -> fsdp2" in out
    _launch(tmp_path, "run.id=piece", "strategy=deepspeed", "strategy.zero_stage=1")

    _close(_losses(tmp_path, "piece"), reference, range(1, 13))
    layout = RunLayout.for_run(tmp_path, "tiny", "piece")
    formats = {s: read_manifest(layout.committed_step(s)).format for s in (4, 8, 12)}
    assert formats == {4: "deepspeed_zero3", 8: "torch_dcp", 12: "deepspeed_zero1"}
    events = _resume_events(tmp_path, "piece")
    assert [(e["from_format"], e["to_format"]) for e in events] == [
        ("deepspeed_zero3", "torch_dcp"),
        ("torch_dcp", "deepspeed_zero1"),
    ]
    # Every step committed along the way still verifies and consolidates: the run's older steps keep their format.
    proc = run_cli(f"run.root={tmp_path}", "run.id=piece", "stage=verify_manifest")
    assert proc.returncode == 0, proc.stderr


def test_global_batch_that_does_not_split_is_refused_up_front(tmp_path: Path) -> None:
    proc = run_cli("+experiment=tiny", f"run.root={tmp_path}", "train.global_batch_size=5")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "does not split evenly over" in proc.stderr and "strategy.world_size=2" in proc.stderr
    assert not (tmp_path / "tiny").exists()
