"""Damage to a piece that several committed steps share (incremental saves, ``pipeline/checkpoint/save/pieces.py``).

A frozen piece hard-linked into steps 4, 8, 12 and 16 (in a bucket: one ``pieces/<hash>`` object they all list)
and one byte of it flipped: ``pipeline.status --verify`` names the damaged file of every step and changes
nothing; the committer's recovery quarantines all four steps together, each note naming the piece, and removes
``latest`` (no step verifies); a plain rerun then writes the piece afresh and commits its steps. A process that
keeps saving while the damage happens links the damaged piece once: that commit fails, takes the committed steps
holding the piece with it, and the next save writes the piece and commits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.checkpoint import Checkpointer
from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer
from pipeline.checkpoint.save import pieces
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.checkpoint.stores.remote import Remote
from pipeline.driver.run_status import collect_checkpoints
from pipeline.status import main as status_main
from pipeline.storage.integrity import FileEntry
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.s3 import S3Url
from tests.s3.helpers import committer as remote_committer
from tests.s3.helpers import keys
from tests.test_incremental import _wait_committed

PIECE = "__0_frozen0.distcp"
STEPS = (4, 8, 12, 16)


class Frozen(torch.nn.Module):
    """A frozen 64x64 layer (its own piece, shared by every later step) and a head that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(64, 64)
        self.base.requires_grad_(False)
        self.head = torch.nn.Linear(64, 4)


def _train(directory: Path, steps: tuple[int, ...], storage: str | None = None, damage: Any = None) -> int:
    """One launch: resume, then train and save ``steps`` (each committed before the next; ``damage(step, model)``
    runs after that step's commit); returns the step it resumed from."""
    torch.manual_seed(0)
    model = Frozen()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    ck = Checkpointer(directory, dedup=True, storage=storage, poll_interval_s=0.05)
    try:
        start = ck.load_latest(state)
        for step in steps:
            model.head(torch.randn(2, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            assert ck.save(step, state).ok
            _wait_committed(ck, step)
            if damage is not None:
                damage(step, model)
    finally:
        ck.close()
    return start


def _flip(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))


def _verify(directory: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = status_main([str(directory), "--verify"])
    return rc, [line for line in capsys.readouterr().out.splitlines() if line.startswith("verify:")]


def _notes(layout: CheckpointLayout) -> dict[int, dict[str, Any]]:
    """The quarantine notes by step (a step dir moved there a moment ago, its note not written yet, is skipped)."""
    return {
        note["step"]: note
        for d in layout.quarantine.iterdir()
        if (d / "quarantine.json").is_file() and (note := json.loads((d / "quarantine.json").read_text()))
    }


def test_a_damaged_piece_shared_by_four_steps_quarantines_them_together_and_a_rerun_commits(
    tmp_path: Path, one_rank: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "ck"
    layout = CheckpointLayout(directory.resolve())
    assert _train(directory, STEPS) == 0
    inodes = {os.stat(layout.committed_step(s) / PIECE).st_ino for s in STEPS}
    assert len(inodes) == 1, "steps 4, 8, 12, 16 hold one frozen piece (one inode)"
    _flip(layout.committed_step(16) / PIECE)

    rc, lines = _verify(directory, capsys)  # status re-hashes on request, names the file, changes nothing
    assert rc == 1 and lines[-1] == "verify: 0 of 4 committed step(s) ok", lines
    for step, line in zip(STEPS, lines, strict=False):
        assert line.startswith(f"verify: step {step} DAMAGED: ") and f"step_{step}/{PIECE}" in line, line
    assert read_latest(layout) is not None and not any(layout.quarantine.iterdir()), "status changed nothing"

    c = Committer(layout, CommitPolicy(world_size=1))
    with c.hold():
        c.recover()
    assert not any(layout.committed_step(s).exists() for s in STEPS), "every step holding the piece is quarantined"
    assert not layout.latest.exists(), "no committed step verifies: latest removed"
    notes = _notes(layout)
    assert sorted(notes) == list(STEPS)
    for note in notes.values():
        damaged = note["shared"]["damaged"]
        assert damaged["files"] == [PIECE] and "content differs" in damaged["reason"], note
        assert damaged["found_in"].endswith("step_16"), note
        assert PIECE in note["reason"], note
    assert len(c.report.quarantined) == 4, c.report.quarantined  # latest's step, then each step holding its piece
    view = collect_checkpoints(layout)["checkpoints"]
    assert sorted(q["step"] for q in view["quarantined"]) == list(STEPS)
    assert _verify(directory, capsys) == (0, ["verify: 0 of 0 committed step(s) ok"])

    # A plain rerun: nothing to resume from; the piece is written afresh, and its steps commit.
    assert _train(directory, (4, 8)) == 0
    assert read_latest(layout) is not None and read_latest(layout).step == 8  # type: ignore[union-attr]
    fresh = {os.stat(layout.committed_step(s) / PIECE).st_ino for s in (4, 8)}
    assert len(fresh) == 1 and fresh.isdisjoint(inodes), "a new piece, shared by the new steps"
    for s in (4, 8):
        verify_committed(layout.committed_step(s), s)
    ok = ["verify: step 4 ok", "verify: step 8 ok", "verify: 2 of 2 committed step(s) ok"]
    assert _verify(directory, capsys) == (0, ok)


def test_a_process_that_links_a_damaged_piece_commits_again_at_its_next_save(tmp_path: Path, one_rank: Any) -> None:
    """Damage lands while the run goes on: step 12 links the damaged piece (same name, size and listed hash), its
    commit fails and takes steps 4 and 8, which hold the piece, with it; ``latest`` goes (nothing verifies).
    Step 16 does not link step 12's piece (this process saved it last, but it was quarantined): it writes it."""
    directory = tmp_path / "ck"
    layout = CheckpointLayout(directory.resolve())

    def damage(step: int) -> None:
        if step == 8:
            _flip(layout.committed_step(8) / PIECE)

    torch.manual_seed(0)
    model = Frozen()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    ck = Checkpointer(directory, dedup=True, poll_interval_s=0.05)
    try:
        for step in (4, 8):
            assert ck.save(step, state).ok
            _wait_committed(ck, step)
        damage(8)
        assert ck.save(12, state).shared > 0, "step 12 links the (damaged) piece of latest"
        q = layout.quarantine
        _until(lambda: q.exists() and sorted(n["step"] for n in _notes(layout).values()) == [4, 8, 12])
        assert not layout.latest.exists()
        result = ck.save(16, state)
        assert result.ok and result.shared == 0, "the piece is written afresh"
        _wait_committed(ck, 16)
    finally:
        ck.close()
    verify_committed(layout.committed_step(16), 16)
    notes = _notes(layout)
    for step in (4, 8):
        assert notes[step]["shared"]["damaged"]["files"] == [PIECE], notes[step]
        assert notes[step]["shared"]["damaged"]["found_in"].endswith("staging/step_12"), notes[step]


def test_a_piece_is_linked_only_from_the_very_file_listed(tmp_path: Path) -> None:
    """The reuse source: a committed step's file of another size is not linked; this process's last save is
    linked only at the inode it wrote (a step quarantined since, or its path holding another file, is not)."""
    layout = CheckpointLayout(tmp_path)
    for d in layout.checkpoint_dirs():
        d.mkdir(parents=True, exist_ok=True)
    src, staged = layout.staged_step(4), layout.staged_step(8)
    src.mkdir()
    staged.mkdir()
    (src / PIECE).write_bytes(b"x" * 100)
    assert not pieces.link_piece(src, staged, PIECE, size=99)
    pieces.remember(layout, 0, 4, (FileEntry(PIECE, 100, "0" * 32),))
    share = PosixCheckpoints(layout).piece_source(0, staged, {"x": "frozen"})
    assert share.reuse(PIECE) and (staged / PIECE).stat().st_ino == (src / PIECE).stat().st_ino
    (src / "other").write_bytes(b"x" * 100)  # the same name and size, another file (the old one still linked)
    os.replace(src / "other", src / PIECE)
    (staged / PIECE).unlink()
    assert not PosixCheckpoints(layout).piece_source(0, staged, {"x": "frozen"}).reuse(PIECE)
    assert not (staged / PIECE).exists()


def test_a_damaged_piece_object_takes_every_manifest_listing_it_and_a_rerun_commits(
    tmp_path: Path, one_rank: Any, bucket: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    storage = f"s3://{bucket}/{prefix}"
    directory = tmp_path / "ck"
    layout = CheckpointLayout(directory.resolve())
    remote = Remote(S3Url.parse(storage), cache_dir=layout.run_dir)
    assert _train(directory, STEPS, storage) == 0
    listed = {
        e.hash
        for s in STEPS
        for e in remote.read_manifest(s)[0].files  # type: ignore[index]
        if e.path == PIECE
    }
    assert len(listed) == 1, "the four steps list one piece object"
    key = remote.pieces_prefix() + listed.pop()
    data = bytearray(remote.store.get(key)[0])  # type: ignore[index]
    data[100] ^= 1
    remote.store.put(key, bytes(data))

    rc, lines = _verify(directory, capsys)
    assert rc == 1 and lines[-1] == "verify: 0 of 4 committed step(s) ok", lines
    assert all(key.rsplit("/", 1)[-1] in line for line in lines[:-1]), lines

    c = remote_committer(layout, remote, world=1)
    with c.hold():
        c.recover()
    assert remote.committed() == [] and remote.read_latest()[0] is None
    reasons = [k for k in keys(bucket, remote.key("quarantine") + "/") if k.endswith("reason.txt")]
    assert sorted(int(k.split("/step_")[1].split("-")[0]) for k in reasons) == list(STEPS)
    for k in reasons:
        assert remote.url(key) in remote.store.get(k)[0].decode(), k  # type: ignore[index]

    assert _train(directory, (4, 8), storage) == 0
    assert remote.committed() == [4, 8] and remote.read_latest()[0].step == 8  # type: ignore[union-attr]
    for s in (4, 8):
        remote.fetch_verified(remote.read_manifest(s)[0], None)  # type: ignore[index]
    assert _verify(directory, capsys)[0] == 0


def test_in_a_bucket_an_older_step_listing_the_damaged_piece_goes_too(
    tmp_path: Path, one_rank: Any, bucket: str, prefix: str
) -> None:
    """Steps 4 and 12 list one frozen piece (its weights changed after step 4 and back after step 8: one content
    key), step 8 another. The piece damaged: step 12 (latest) goes, and step 4 with it although step 8 verifies
    and becomes ``latest``."""
    storage = f"s3://{bucket}/{prefix}"
    directory = tmp_path / "ck"
    layout = CheckpointLayout(directory.resolve())
    remote = Remote(S3Url.parse(storage), cache_dir=layout.run_dir)
    kept: dict[str, torch.Tensor] = {}

    def toggle(step: int, model: Frozen) -> None:
        with torch.no_grad():
            if step == 4:
                kept["w"] = model.base.weight.clone()
                model.base.weight.add_(1.0)
            elif step == 8:
                model.base.weight.copy_(kept["w"])

    _train(directory, (4, 8, 12), storage, toggle)
    piece = {s: next(e.hash for e in remote.read_manifest(s)[0].files if e.path == PIECE) for s in (4, 8, 12)}  # type: ignore[index]
    assert piece[4] == piece[12] != piece[8]
    key = remote.pieces_prefix() + piece[4]
    data = bytearray(remote.store.get(key)[0])  # type: ignore[index]
    data[100] ^= 1
    remote.store.put(key, bytes(data))
    c = remote_committer(layout, remote, world=1)
    with c.hold():
        c.recover()
    assert remote.committed() == [8] and remote.read_latest()[0].step == 8  # type: ignore[union-attr]
    reasons = {
        int(k.split("/step_")[1].split("-")[0]): remote.store.get(k)[0].decode()  # type: ignore[index]
        for k in keys(bucket, remote.key("quarantine") + "/")
        if k.endswith("reason.txt")
    }
    assert sorted(reasons) == [4, 12] and all(remote.url(key) in r for r in reasons.values()), reasons


def _until(done: Any, timeout_s: float = 30.0) -> None:
    import time  # noqa: PLC0415

    until = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < until, "not within 30 s"
        time.sleep(0.05)
