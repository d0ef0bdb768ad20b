"""A library job with ``committer="external"``: ``close()`` waits, bounded, until a committer has moved ``latest`` to
the last step the job saved, and names what is missing otherwise: steps nobody committed (kept in staging for
``python -m pipeline.commit``), steps published with ``latest`` not moved to them, steps quarantined."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.checkpoint import Checkpointer
from pipeline.checkpoint.manifest import Latest, read_latest, verify_committed
from pipeline.checkpoint.save import external_wait
from pipeline.checkpoint.stores import stores
from pipeline.storage.layout import CheckpointLayout
from tests.conftest import ROOT

LOGGER = "pipeline.checkpoint.checkpointer"


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def _commit(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipeline.commit", str(directory), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def _follow(directory: Path, faults: str = "", storage: str | None = None) -> subprocess.Popen[str]:
    """``pipeline.commit --follow`` beside the job, returned once it holds the dir (``faults``: its
    ``PIPELINE_FAULTS``; ``storage``: the bucket); its output goes to a file beside ``directory``."""
    env = {**os.environ, "PIPELINE_FAULTS": faults}
    log_file = (directory.parent / f"{directory.name}-follow.log").open("w")
    cmd = [sys.executable, "-m", "pipeline.commit", str(directory), "--follow", "--interval", "0.1"]
    cmd += ["--storage", storage] if storage is not None else []
    follow = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    log_file.close()
    store = stores.library_store(CheckpointLayout(directory), storage)
    deadline = time.monotonic() + 60
    while not stores.committer_running(store):  # the committer is up
        assert follow.poll() is None and time.monotonic() < deadline, "the committer did not start"
        time.sleep(0.1)
    return follow


def _stop(follow: subprocess.Popen[str]) -> None:
    follow.terminate()
    follow.wait(60)


def test_steps_nobody_committed_are_named_and_a_later_commit_publishes_them(
    one_rank: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = CheckpointLayout(tmp_path)
    state = _state()
    ck = Checkpointer(tmp_path, committer="external", deadline_s=30, external_commit_wait_s=0.5)
    assert ck.save(4, state).ok and ck.save(8, state).ok
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ck.close()
    assert time.monotonic() - t0 < 10, "close waits external_commit_wait_s with no committer, not deadline_s"
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert warnings == [
        f"steps 4, 8 staged in {layout.checkpoints} were not committed: no committer ran "
        f"(start `python -m pipeline.commit {tmp_path}`); they are kept in staging"
    ], warnings
    assert layout.staged_step(4).is_dir() and layout.staged_step(8).is_dir() and read_latest(layout) is None

    done = _commit(tmp_path)
    assert done.returncode == 0, done.stderr
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    for step in (4, 8):
        verify_committed(layout.committed_step(step), step)


def test_close_waits_for_a_running_committer_to_commit_the_last_step(
    one_rank: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = CheckpointLayout(tmp_path)
    state = _state()
    ck = Checkpointer(tmp_path, committer="external", deadline_s=60, external_commit_wait_s=30)
    follow = _follow(tmp_path)
    try:
        assert ck.save(4, state).ok and ck.save(8, state).ok
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            ck.close()
        # close returns once latest names the last step the job saved (not once the step left staging): however
        # slow the committer, latest is 8 here, and nothing is left to name
        assert read_latest(layout).step == 8  # type: ignore[union-attr]
        assert not _warnings(caplog)
    finally:
        _stop(follow)


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_close_waits_for_latest_to_move_not_for_the_last_step_to_be_published(
    backend: str, one_rank: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    """The committer publishes step 8, then takes 3 s to move latest to it: close returns only after that (the
    old close returned as soon as the step was published, latest still 4: issue 33)."""
    storage = None
    if backend == "s3":
        storage = f"s3://{request.getfixturevalue('bucket')}/{request.getfixturevalue('prefix')}"
    state = _state()
    ck = Checkpointer(tmp_path, committer="external", deadline_s=60, external_commit_wait_s=30, storage=storage)
    store = stores.library_store(CheckpointLayout(tmp_path), storage)
    follow = _follow(tmp_path, faults="verify.before_latest@step=8@action=sleep@seconds=3", storage=storage)
    try:
        assert ck.save(4, state).ok and ck.save(8, state).ok
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            ck.close()
        assert store.read_latest().step == 8  # type: ignore[union-attr]
        assert not _warnings(caplog)
    finally:
        _stop(follow)


def test_a_quarantined_last_step_is_named_without_waiting_for_the_deadline(
    one_rank: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 8's staged files are damaged: the running committer commits 4 and quarantines 8. latest can never
    name 8, so close names it at once rather than after deadline_s."""
    layout = CheckpointLayout(tmp_path)
    state = _state()
    ck = Checkpointer(tmp_path, committer="external", deadline_s=120, external_commit_wait_s=120)
    assert ck.save(4, state).ok and ck.save(8, state).ok
    victim = max((p for p in layout.staged_step(8).rglob("*.distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    follow = _follow(tmp_path)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            ck.close()
        assert time.monotonic() - t0 < 60, "close waited for the deadline for a step no committer will commit"
        assert read_latest(layout).step == 4  # type: ignore[union-attr]
        assert _warnings(caplog) == [
            f"step 8 saved in {layout.checkpoints} is neither staged nor published (quarantined?): no committer will "
            "move latest to it: see the committer's log and the quarantine"
        ], _warnings(caplog)
        assert any(p.name.startswith("step_8") for p in layout.quarantine.iterdir())
    finally:
        _stop(follow)


# -- the wait itself, against a scripted store (no committer process, no timing) -----------------------------------


@dataclass
class _Script:
    """A store whose ``latest`` and steps change as a committer would, one change per look at ``latest``."""

    latest: list[int | None]
    """What successive reads of ``latest`` return (the last one from then on)."""
    published: list[int] = field(default_factory=list)
    staging: list[int] = field(default_factory=list)
    reads: int = 0
    where: str = "/ckpt/checkpoints"
    poll_s: float = 0.01

    def read_latest(self) -> Latest | None:
        step = self.latest[min(self.reads, len(self.latest) - 1)]
        self.reads += 1
        return Latest(step=step, manifest_hash="x") if step is not None else None

    def newest(self) -> Latest | None:  # what a reader resumes from (the old close waited on it: issue 33)
        latest = self.read_latest()
        newer = [s for s in self.published if latest is None or s > latest.step]
        return Latest(step=max(newer), manifest_hash="x") if newer else latest

    def is_published(self, step: int) -> bool:
        return step in self.published

    def staged(self) -> list[int]:
        return list(self.staging)


def _await(
    monkeypatch: pytest.MonkeyPatch, store: _Script, saved: list[int], running: bool, deadline_s: float = 0.3
) -> None:
    monkeypatch.setattr(stores, "store_for", lambda layout, remote: store)
    monkeypatch.setattr(stores, "committer_running", lambda s, watch=None: running)
    external_wait.await_external_commit(CheckpointLayout(Path("/ckpt")), None, 1, saved, deadline_s, 0.3)


def test_the_wait_ends_on_latest_not_on_the_step_being_published(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # step 8 is published from the first look; latest names 4 for 5 reads, then 8
    store = _Script(latest=[4, 4, 4, 4, 4, 8], published=[4, 8])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _await(monkeypatch, store, [4, 8], running=True, deadline_s=60)
    assert store.reads >= 6 and not _warnings(caplog)
    # latest beyond the last step saved (another job's newer step) is enough
    store = _Script(latest=[12], published=[12])
    _await(monkeypatch, store, [4, 8], running=True, deadline_s=60)
    assert store.reads == 1 and not _warnings(caplog)


def test_at_the_deadline_each_missing_step_is_named_with_where_it_is(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = _Script(latest=[4], published=[4, 8], staging=[12])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _await(monkeypatch, store, [4, 8, 12, 16], running=True)
    assert _warnings(caplog) == [
        "step 12 staged in /ckpt/checkpoints was not committed; step 8 was published in /ckpt/checkpoints but "
        "latest still names step 4 (not moved to it); step 16 saved in /ckpt/checkpoints is neither staged nor "
        "published (quarantined?): the committer of /ckpt/checkpoints did not commit them within deadline_s=0.3s; "
        "step 12 is kept in staging"
    ], _warnings(caplog)
    caplog.clear()
    store = _Script(latest=[None], published=[4, 8])  # published, latest never written, no committer seen
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _await(monkeypatch, store, [4, 8], running=False)
    assert _warnings(caplog) == [
        "steps 4, 8 were published in /ckpt/checkpoints but latest names no step yet (not moved to them): "
        "no committer was seen running (start `python -m pipeline.commit /ckpt`)"
    ], _warnings(caplog)
