"""The library's guarantees, proven on the library itself (a one-rank gloo world in this process): crash at every
I/O op of a ``Checkpointer`` save and its commit, hostile files under its dir, concurrent committers, and async
writers that die or stall. The app's stages run the same code (``rank_save``, ``Committer``); the multi-rank
kill -9 of a rank and of the committer's rank is in ``tests/test_examples.py``.
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.checkpoint import Checkpointer, CommitPolicy, Committer, CommitterBusy
from pipeline.checkpoint.manifest import complete_markers, read_latest, step_markers, verify_committed
from pipeline.checkpoint.protocol import step_checks
from pipeline.checkpoint.stores import posix_store
from pipeline.errors import PipelineError, VerificationError
from pipeline.storage import faults, integrity
from pipeline.storage.layout import CheckpointLayout
from tests.reliability.conftest import record, sized
from tests.reliability.test_crash_points import _crash, litter, pick_points, tree_hashes
from tests.reliability.test_protocol_mutants import no_in_place_writes, renames_reach_disk

pytestmark = [pytest.mark.reliability]
ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.05
"""The committer thread's poll: ``close`` joins it, so each Checkpointer's close waits out up to one poll (the
default 0.5 s, paid at every crash point's relaunch)."""


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _base(root: Path) -> Path:
    """A library dir with step 4 committed."""
    model, opt = _model()
    _train(model, opt, 4)
    with Checkpointer(root, committer="thread", deadline_s=10, poll_interval_s=POLL_S) as ck:
        assert ck.save(4, {"model": model, "optim": opt}).ok
    return root


def _load(root: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """What a relaunched script does: a fresh Checkpointer (its committer recovers first), load_latest."""
    model, opt = _model()
    with Checkpointer(root, deadline_s=10, poll_interval_s=POLL_S) as ck:
        step = ck.load_latest(into={"model": model, "optim": opt})
    return step, _weights(model)


@pytest.mark.usefixtures("no_lease_settle")  # one committer at a time: a lease per crash point and relaunch
def test_crash_at_every_io_op_of_a_library_save_and_commit(one_rank: object, tmp_path: Path) -> None:
    base = _base(tmp_path / "base")
    layout_of = CheckpointLayout
    model, opt = _model()
    _train(model, opt, 8)
    state, want8 = {"model": model, "optim": opt}, _weights(model)

    def save_and_commit(root: Path) -> None:
        # committer="external" keeps the trace deterministic: the commit runs here, not in a thread (and close
        # does not wait for another committer). After a simulated crash the lease record the crashed commit left
        # looks alive, and close waits for it to commit until deadline_s: a real crashed process never gets
        # there, so the deadline is short (every wait of a one-rank save has nobody else to wait for).
        ck = Checkpointer(root, committer="external", deadline_s=1, external_commit_wait_s=0)
        try:
            if not ck.save(8, state).ok:
                raise PipelineError("the save failed")
            committer = Committer(layout_of(root), CommitPolicy(world_size=1, marker_deadline_s=1))
            with committer.hold():
                committer.recover()
                committer.commit_ready()
        finally:
            ck.close()

    clean = tmp_path / "clean"
    shutil.copytree(base, clean)
    with faults.tracing() as trace:
        save_and_commit(clean)
    clean_step = tree_hashes(clean / "checkpoints/step_8")
    intact = tree_hashes(base / "checkpoints/step_4")
    problems = [f"trace: {p}" for p in renames_reach_disk(trace, layout_of(clean)) + no_in_place_writes(trace)]
    points = pick_points(trace, sized(40, len(trace)))
    t0 = time.monotonic()
    for n in points:
        problems += [f"op {n}: {f}" for f in _crash_point(base, tmp_path / f"p{n}", n, save_and_commit, want8)]
        run = tmp_path / f"p{n}"
        if tree_hashes(run / "checkpoints/step_4") != intact:
            problems.append(f"op {n}: the committed step 4 changed")
        got = tree_hashes(run / "checkpoints/step_8")
        if {k for k in got if k.endswith(".distcp")} != {k for k in clean_step if k.endswith(".distcp")}:
            problems.append(f"op {n}: step 8's data files differ from a clean save's")
        litter_in_step = [x for x in litter(run) if x.startswith("checkpoints/step_8/")]
        problems += [f"op {n}: temp file in the committed step: {x}" for x in litter_in_step]
        shutil.rmtree(run, ignore_errors=True)
    figure = f"{len(points)}/{len(trace)} points, {len(problems)} violations ({time.monotonic() - t0:.0f}s)"
    record("crash points: library save + commit", figure, ok=not problems, notes=problems[:4])
    assert not problems, "\n".join(problems[:20])


def _crash_point(
    base: Path, run: Path, n: int, save_and_commit: Callable[[Path], None], want8: dict[str, torch.Tensor]
) -> list[str]:
    """Crash at op ``n`` of a save + commit in a copy of ``base``, relaunch, and say what went wrong."""
    shutil.copytree(base, run)
    plan = _crash(functools.partial(save_and_commit, run), n)
    found = [] if plan.crashed else [f"op {n} was never reached"]
    layout = CheckpointLayout(run)
    try:
        step, weights = _load(run)  # recover + commit what is complete, then resume
        if step not in (4, 8):
            found.append(f"resumed from step {step}")
        if step == 8 and any(not weights[k].equal(want8[k]) for k in want8):
            found.append("step 8 resumed other weights than were saved")
        if step == 4:
            save_and_commit(run)
    except (PipelineError, OSError) as e:
        found.append(f"the relaunch failed: {type(e).__name__}: {e}")
    latest = read_latest(layout)
    if latest is None or latest.step != 8:
        found.append(f"latest is {latest} after the rerun")
    else:
        verify_committed(layout.committed_step(8), 8)
    return found


def test_a_damaged_latest_step_is_quarantined_and_resume_falls_back(
    one_rank: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pipeline.checkpoint.resume")
    assert _load(tmp_path / "empty")[0] == 0  # a first launch says so in one line too
    assert f"no committed step in {tmp_path / 'empty' / 'checkpoints'}: starting from step 0" in caplog.messages
    model, opt = _model()
    with Checkpointer(tmp_path, deadline_s=10) as ck:
        for step in (1, 2):
            _train(model, opt, 1)
            assert ck.save(step, {"model": model, "optim": opt}).ok
    layout = CheckpointLayout(tmp_path)
    data = next(p for p in layout.committed_step(2).iterdir() if p.name.endswith(".distcp"))
    with open(data, "r+b") as f:  # one flipped byte in a committed file
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    step, _ = _load(tmp_path)
    assert step == 1, "resume must fall back to the newest step that verifies"
    resumed = f"resumed from step 1 of {tmp_path / 'checkpoints'} (committed, verified against its manifest)"
    assert caplog.messages.count(resumed) == 1, caplog.messages
    assert [p.name for p in layout.quarantine.iterdir() if p.name.startswith("step_2")], "step 2 is quarantined"


def test_a_planted_symlink_step_is_never_published(one_rank: object, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    layout = CheckpointLayout(tmp_path / "run")
    model, opt = _model()
    with Checkpointer(layout.run_dir, deadline_s=10) as ck:
        assert ck.save(1, {"model": model, "optim": opt}).ok
    (layout.staging / "step_2").symlink_to(outside)
    step, _ = _load(layout.run_dir)
    assert step == 1
    assert read_latest(layout).step == 1  # type: ignore[union-attr]
    assert not (layout.checkpoints / "step_2").exists() and not any(outside.iterdir())


def test_exactly_one_committer_holds_a_dir_and_one_publishes_a_race(
    one_rank: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = CheckpointLayout(tmp_path)
    model, opt = _model()
    ck = Checkpointer(tmp_path, committer="thread", deadline_s=10)
    try:
        with pytest.raises(CommitterBusy), Committer(layout, CommitPolicy(world_size=1)).hold():
            pass  # a second committer beside the rank-0 thread
        cmd = [sys.executable, "-m", "pipeline.commit", str(tmp_path)]
        cli = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        assert cli.returncode == 2 and "another committer" in cli.stderr, cli.stderr
    finally:
        ck.close()
    ck = Checkpointer(tmp_path, committer="external", deadline_s=10, external_commit_wait_s=0)  # committed below
    assert ck.save(3, {"model": model, "optim": opt}).ok
    ck.close()
    markers = complete_markers(step_markers(layout.staged_step(3), 3, 1), None)
    assert markers is not None
    # Without the lock (two hosts whose flock does not meet): both race to commit the same step.
    outcomes: list[str] = []
    gate = threading.Barrier(2)

    def commit() -> None:
        gate.wait()
        try:
            Committer(layout, CommitPolicy(world_size=1)).commit(3, markers)
            outcomes.append("published")
        except (PipelineError, OSError) as e:
            outcomes.append(type(e).__name__)

    threads = [threading.Thread(target=commit) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # One rename publishes; the other committer finds the step published from the same attempt (the same manifest
    # bytes) and accepts it: a duplicate's publish is harmless, never a failure nor a second copy.
    assert outcomes == ["published", "published"], outcomes
    assert not layout.staged_step(3).exists() and not any(layout.quarantine.iterdir())
    verify_committed(layout.committed_step(3), 3)
    assert read_latest(layout).step == 3  # type: ignore[union-attr]
    # The same race, its windows made certain: the other committer publishes the step after this one hashed the
    # files and before it reads the format's metadata (CI once saw "CheckpointFormatError: .metadata is missing"),
    # or after this one wrote the manifest and before its own rename (CI once saw "UnsafePathError: cannot
    # publish ... not a directory"), or while this one hashes the staged files (CI once saw "FileNotFoundError:
    # .../staging/step_3/__0_1.distcp": the file had moved with the other's rename).
    windows = ((4, (step_checks, "check_stored")), (5, (posix_store, "inject")), (6, (integrity, "hash_file")))
    for step, window in windows:
        ck = Checkpointer(tmp_path, committer="external", deadline_s=10, external_commit_wait_s=0)
        assert ck.save(step, {"model": model, "optim": opt}).ok
        ck.close()
        markers = complete_markers(step_markers(layout.staged_step(step), step, 1), None)
        assert markers is not None
        monkeypatch.setattr(*window, _published_meanwhile(monkeypatch, layout, window, step, markers))
        assert Committer(layout, CommitPolicy(world_size=1)).commit(step, markers) == "", window  # left to the other
        assert read_latest(layout).step == step and not any(layout.quarantine.iterdir())  # type: ignore[union-attr]


def _published_meanwhile(
    monkeypatch: pytest.MonkeyPatch, layout: CheckpointLayout, window: tuple[Any, str], step: int, markers: Any
) -> Callable[..., Any]:
    """``window``'s function, which lets another committer publish ``step`` whole before it runs (once)."""
    plain = getattr(*window)

    def run(*args: object, **kwargs: object) -> Any:
        monkeypatch.setattr(*window, plain)  # the other committer's own commit runs plain
        Committer(layout, CommitPolicy(world_size=1)).commit(step, markers)
        return plain(*args, **kwargs)

    return run


@pytest.mark.parametrize("fault", ["async_save.mid_write", "async_save.before_write@action=sleep@seconds=4"])
def test_an_async_writer_that_dies_or_stalls_is_named_and_never_committed(
    one_rank: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    model, opt = _model()
    state = {"model": model, "optim": opt}
    ck = Checkpointer(tmp_path, deadline_s=2)
    try:
        ck.save_async(1, state)
        first = ck.wait()
        assert first is not None and first.ok
        monkeypatch.setenv("PIPELINE_FAULTS", fault + "@step=2")
        t0 = time.monotonic()
        ck.save_async(2, state)
        failed = ck.wait()
        assert failed is not None and not failed.ok and "step 2" in failed.error, failed
        assert time.monotonic() - t0 < 2 + 5, "named within its deadline"
        monkeypatch.delenv("PIPELINE_FAULTS")
        ck.save_async(3, state)  # a fresh buffer and group: the next save works
        third = ck.wait()
        assert third is not None and third.ok
    finally:
        ck.close()
    layout = CheckpointLayout(tmp_path)
    assert read_latest(layout).step == 3  # type: ignore[union-attr]
    assert not layout.committed_step(2).exists(), "a failed async save is never committed"
    with pytest.raises(VerificationError):
        verify_committed(layout.committed_step(2), 2)
