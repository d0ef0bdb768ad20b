"""A read that fails is unknown, never damage (docs/design.md, "Unknown is not damage").

Only bytes read whole that are wrong may quarantine a step, move ``latest`` back or make a reader pick an older
step. A read that fails (``EIO`` while a FUSE client's filer is away, NFS ``ESTALE``) is retried for a bounded
time; if it keeps failing, the act is not taken. Each test here failed on b7e80a6, where one ``EIO`` on opening
``step_4/manifest.json`` sent the newest good step to quarantine (and, with ``keep_last=1``, a resume to step 0).
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipeline.checkpoint.manifest import read_latest, read_manifest, read_newest, verify_committed
from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.checkpoint.stores.store import Taken
from pipeline.errors import ReadFailed, VerificationError
from pipeline.rundir.layout import RunLayout
from pipeline.storage import integrity, reads
from tests.seed_helpers import stage_rank

WORLD = 2


def _committed(tmp_path: Path, steps: tuple[int, ...], keep_last: int | None = None) -> RunLayout:
    layout = RunLayout(tmp_path / "run")
    layout.checkpoints.mkdir(parents=True)
    for step in steps:
        for rank in range(WORLD):
            stage_rank(layout, step, rank, world=WORLD, attempt="a1")
        c = Committer(layout, CommitPolicy(world_size=WORLD, keep_last=keep_last))
        with c.hold():
            c.recover()
            assert c.commit_ready() == [step]
    return layout


def _quarantined(layout: RunLayout) -> list[str]:
    q = layout.checkpoints / "quarantine"
    return sorted(os.listdir(q)) if q.is_dir() else []


@pytest.fixture
def failing(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, int, int], list[str]]]:
    """``failing(name, times, err)``: the next ``times`` opens (and stats) of a path ending in ``name`` fail with
    ``err``, as a FUSE client's do while its filer is away; returns the paths that failed."""
    seen: list[str] = []
    left: dict[str, list[int]] = {}
    real_open, real_lstat = os.open, os.lstat

    def arm(name: str, times: int, err: int) -> list[str]:
        left[name] = [times, err]
        return seen

    def hit(path: object) -> None:
        for name, state in left.items():
            if str(path).endswith(name) and state[0] > 0:
                state[0] -= 1
                seen.append(str(path))
                raise OSError(state[1], os.strerror(state[1]), str(path))

    def fake_open(path: object, *args: object, **kwargs: object) -> int:
        hit(path)
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    def fake_lstat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        hit(path)
        return real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(integrity.os, "open", fake_open)
    monkeypatch.setattr(reads.os, "lstat", fake_lstat)
    monkeypatch.setattr(reads, "READ_RETRY_S", 0.5)
    yield arm


# Finding 1: one EIO while a starting committer re-checks latest quarantined the newest good step.
@pytest.mark.parametrize("err", [errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ENOTCONN])
def test_one_failed_read_of_latests_manifest_quarantines_nothing(
    tmp_path: Path, failing: Callable[[str, int, int], list[str]], err: int
) -> None:
    layout = _committed(tmp_path, (2, 4))
    seen = failing("step_4/manifest.json", 1, err)
    c = Committer(layout, CommitPolicy(world_size=WORLD))
    with c.hold():
        c.recover()
    assert seen, "the fault was never hit: the test would pass on any code"
    assert _quarantined(layout) == [] and c.report.quarantined == []
    latest = read_latest(layout)
    assert latest is not None and latest.step == 4


def test_a_read_that_keeps_failing_takes_no_act_even_with_keep_last_1(
    tmp_path: Path, failing: Callable[[str, int, int], list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    layout = _committed(tmp_path, (2, 4), keep_last=1)
    seen = failing("step_4/manifest.json", 10_000, errno.EIO)
    c = Committer(layout, CommitPolicy(world_size=WORLD, keep_last=1))
    with c.hold(), caplog.at_level(logging.WARNING, "pipeline"):
        assert c.recover_or_defer() is False  # deferred: the store cannot be read now
    assert seen
    assert _quarantined(layout) == [] and c.report.quarantined == []
    assert (layout.checkpoints / "step_4" / "manifest.json").is_file()
    one = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(one) == 1 and "step_4/manifest.json" in one[0] and "Input/output error" in one[0], one
    # the filer back: the same committer's next pass recovers, and latest is still step 4
    failing("step_4/manifest.json", 0, errno.EIO)
    with c.hold():
        c.follow(alive=lambda: False)
    latest = read_latest(layout)
    assert latest is not None and latest.step == 4 and _quarantined(layout) == []


def test_a_reader_never_takes_an_older_step_because_a_read_failed(
    tmp_path: Path, failing: Callable[[str, int, int], list[str]]
) -> None:
    layout = _committed(tmp_path, (2, 4))
    failing("step_4/manifest.json", 10_000, errno.EIO)
    with pytest.raises(ReadFailed, match=r"step_4/manifest.json.*unknown, not damage"):
        read_newest(layout)


def test_a_data_file_that_cannot_be_read_is_not_damage(
    tmp_path: Path, failing: Callable[[str, int, int], list[str]]
) -> None:
    layout = _committed(tmp_path, (2, 4))
    seen = failing("step_4/__1_0.distcp", 10_000, errno.EIO)
    c = Committer(layout, CommitPolicy(world_size=WORLD))
    with c.hold():
        assert c.recover_or_defer() is False
    assert seen and _quarantined(layout) == []
    latest = read_latest(layout)
    assert latest is not None and latest.step == 4


def test_a_staged_steps_marker_that_cannot_be_read_is_left_for_the_next_pass(
    tmp_path: Path, failing: Callable[[str, int, int], list[str]]
) -> None:
    layout = _committed(tmp_path, (2,))
    for rank in range(WORLD):
        stage_rank(layout, 4, rank, world=WORLD, attempt="a1")
    failing("step_4/rank_1.done.json", 10_000, errno.EIO)
    c = Committer(layout, CommitPolicy(world_size=WORLD, marker_deadline_s=0.5))
    with c.hold():
        c.recover()
        assert c.commit_ready() == []
        c.finish(None, alive=lambda: False)
    assert _quarantined(layout) == [] and (layout.staged_step(4) / "rank_1.done.json").is_file()
    assert [s for s, _ in c.report.incomplete] == [4]
    with pytest.raises(VerificationError, match="step 4"):
        c.raise_problems()  # the job says so in one line; the next run commits it
    failing("step_4/rank_1.done.json", 0, errno.EIO)
    c = Committer(layout, CommitPolicy(world_size=WORLD))
    with c.hold():
        c.recover()
        assert c.commit_ready() == [4]


def test_bytes_read_whole_that_differ_are_still_damage(tmp_path: Path) -> None:
    layout = _committed(tmp_path, (2, 4))
    shard = layout.committed_step(4) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    c = Committer(layout, CommitPolicy(world_size=WORLD))
    with c.hold():
        c.recover()
    assert _quarantined(layout) and any("step 4" in q or "step_4" in q for q in c.report.quarantined)
    latest = read_latest(layout)
    assert latest is not None and latest.step == 2


def test_a_listed_file_that_shows_within_the_settle_is_not_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file another node renamed into place may look absent through this node's mount for a moment."""
    layout = _committed(tmp_path, (2, 4))
    shard = layout.committed_step(4) / "__1_0.distcp"
    aside = shard.with_name("aside")
    shard.rename(aside)
    real_lstat = os.lstat
    looks = [0]

    def lagging(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path) == str(shard):
            looks[0] += 1
            if looks[0] == 2:
                aside.rename(shard)  # shows on the second look
        return real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reads.os, "lstat", lagging)
    monkeypatch.setenv("PIPELINE_ABSENT_SETTLE_S", "2")
    c = Committer(layout, CommitPolicy(world_size=WORLD))
    with c.hold():
        c.recover()
    assert looks[0] >= 2 and _quarantined(layout) == []
    monkeypatch.setenv("PIPELINE_ABSENT_SETTLE_S", "0.1")
    shard.unlink()  # and one that stays absent is missing: damage
    c = Committer(layout, CommitPolicy(world_size=WORLD))
    with c.hold():
        c.recover()
    assert _quarantined(layout)


# Finding 2: a ghost that verified attempt a1 and froze before its publish renamed the a2 dir the trainer had
# saved since into place and wrote a1's manifest into it: readers were told to resume from a step that does not
# verify, and the next committer quarantined the good a2 copy.
@pytest.mark.parametrize("a2_ranks", [WORLD, 1], ids=["a2 complete", "a2 half-written"])
def test_a_late_publish_never_takes_another_attempts_bytes(tmp_path: Path, a2_ranks: int) -> None:
    layout = _committed(tmp_path, (2,))
    for rank in range(WORLD):
        stage_rank(layout, 4, rank, world=WORLD, attempt="a1")
    store = PosixCheckpoints(layout)
    markers = [m for m in store.markers(4, None, WORLD) if m is not None]
    verified = store.verify_staged(4, markers, allow_pickle=False)  # the ghost verifies a1, then freezes
    # meanwhile a1 is committed, found damaged, quarantined; latest falls back to 2; the trainer saves 4 again
    (layout.checkpoints / "quarantine").mkdir()
    layout.staged_step(4).rename(layout.checkpoints / "quarantine" / "step_4.a1")
    for rank in range(a2_ranks):
        stage_rank(layout, 4, rank, world=WORLD, attempt="a2")
    with pytest.raises(Taken, match="not attempt a1 as verified"):
        store.publish(verified)  # the ghost thaws
    assert not (layout.committed_step(4) / "manifest.json").exists()
    newest = read_newest(layout)
    assert newest is not None and newest.step == 2  # no reader is told to resume from a step that does not verify
    c = Committer(layout, CommitPolicy(world_size=WORLD))
    with c.hold():
        c.recover()
        c.commit_ready()
    latest = read_latest(layout)
    if a2_ranks == WORLD:  # what it moved is a2 whole: verified for what it holds, and committed
        assert latest is not None and latest.step == 4
        verify_committed(layout.committed_step(4), 4)
        assert read_manifest(layout.committed_step(4)).attempt == "a2"
    else:  # half of a2: no committed step; latest stays where it was, nothing good is quarantined
        assert latest is not None and latest.step == 2
    assert os.listdir(layout.checkpoints / "quarantine") == ["step_4.a1"]


def test_a_damaged_manifest_of_latests_step_is_damage_and_the_committer_repairs_it(tmp_path: Path) -> None:
    """Record damage, not only data damage (the simulation's seed 1000027): ``latest`` names step 4, whose
    manifest was rewritten with a wrong hash; the starting committer stopped with a VerificationError instead
    of repairing it."""
    layout = _committed(tmp_path, (2, 4))
    manifest = layout.committed_step(4) / "manifest.json"
    record = json.loads(manifest.read_text())
    record["files"][0]["hash"] = "0" * 32
    manifest.write_text(json.dumps(record))
    c = Committer(layout, CommitPolicy(world_size=WORLD))
    with c.hold():
        c.recover()
    latest = read_latest(layout)
    assert latest is not None and latest.step == 2
    assert _quarantined(layout) and not layout.committed_step(4).exists()
