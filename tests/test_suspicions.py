"""The five suspicions of issue 48 (an adversarial review of b7e80a6), each replayed by a directed test: the real
committers in the simulation (:mod:`tests.sim`), one frozen at a chosen line of its code while the others run, or
the real functions called in the order the interleaving takes. Where the hole was real, the test failed before its
fix (the comment says how) and stays as a regression test; where it cannot happen, the test shows why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.sim.directed import after, at, ended, plan, run
from tests.sim.world import Settings, World


def latest_is(step: int) -> Callable[[World], bool]:
    return lambda w: w.raw_store().latest_named() == step


def both(*conds: Callable[[World], bool]) -> Callable[[World], bool]:
    return lambda w: all(c(w) for c in conds)


def clean(w: World) -> None:
    assert not w.violations, w.violations
    errors = [f"{a.name}: {a.error!r}" for a in w.kernel.actors if a.error is not None]
    assert not errors, errors


# (a) Real. In a bucket, a ghost wrote step 4's manifest (attempt a1, the commit point) and froze before reading
#     its rank 0 marker back. The live committer found step 4 damaged, quarantined it (a1's objects and the
#     manifest), the trainer saved step 4 again (a2) and the live committer committed it. The ghost thawed, found
#     a1's marker gone and deleted step_4/manifest.json unconditionally: the a2 manifest. On b7e80a6 `latest`
#     named step 4 and its manifest was gone ("a reader cannot resume"). The ghost now takes back only the object
#     it wrote: a conditional overwrite (If-Match: its own ETag) with an empty object, which commits nothing (S3
#     has no conditional delete that every server honours; a conditional PUT it has, and the store requires it).
def test_a_a_ghosts_late_take_back_of_its_manifest_leaves_a_newer_attempts_manifest(tmp_path: Path) -> None:
    w = plan(
        Settings(store="bucket", steps=(), keep_last=3, live_at=1.0),
        tmp_path,
        run(
            "ghost",
            until=after(at("ghost", "s3.put", "step_4/manifest.json"), at("ghost", "s3.list", "step_4/a1/")),
            then=lambda w: w.stage_now(2, 4),
        ),
        run(
            "live",
            until=both(at("live", "sleep 2"), lambda w: 4 not in w.raw_store().committed()),
            then=lambda w: w.damage(4),
        ),  # fmt: skip
        run("live", until=both(at("live", "sleep 2"), latest_is(4)), then=lambda w: w.stage_now(4, attempt="a2")),
        run("ghost", until=ended("ghost")),
        run("live", then=lambda w: w.finish_writer()),
    )
    clean(w)
    assert w.final_ok == [2, 4] and w.final_reader[:2] == ("ok", 4), (w.final_ok, w.final_reader)


def _memory_remote(tmp: Path, monkeypatch: pytest.MonkeyPatch, point: Callable[[str, str], None]) -> Any:
    """A checkpoints root in a bucket in memory (:mod:`tests.sim.memory_s3`) whose every request calls ``point``."""
    from pipeline.checkpoint.stores import remote  # noqa: PLC0415
    from pipeline.storage.layout import CheckpointLayout  # noqa: PLC0415
    from pipeline.storage.s3 import S3Url  # noqa: PLC0415
    from tests.sim.memory_s3 import MemoryBucket  # noqa: PLC0415

    monkeypatch.setattr(remote, "S3Store", MemoryBucket(point).store)
    layout = CheckpointLayout(tmp / "run")
    for d in layout.checkpoint_dirs():
        d.mkdir(parents=True, exist_ok=True)
    return layout, remote.Remote(root=S3Url("sim", "runs/r1"), cache_dir=layout.run_dir)


def _commit_in_bucket(layout: Any, remote: Any, step: int, attempt: str) -> None:
    """``step`` saved by one rank (its objects, then its marker) and committed (verified, its manifest written)."""
    import shutil  # noqa: PLC0415

    from pipeline.checkpoint.manifest import Marker  # noqa: PLC0415
    from pipeline.checkpoint.stores.bucket_store import BucketCheckpoints  # noqa: PLC0415
    from pipeline.storage.integrity import describe  # noqa: PLC0415
    from tests.seed_helpers import TEST_FORMAT, shard_bytes  # noqa: PLC0415

    scratch = layout.run_dir / "upload" / f"step_{step}-{attempt}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    (scratch / "__0_0.distcp").write_bytes(shard_bytes(step, 0, "__0_0.distcp") + attempt.encode())
    marker = Marker(step=step, rank=0, world_size=1, format=TEST_FORMAT, attempt=attempt,
                    files=(describe(scratch, "__0_0.distcp"),))  # fmt: skip
    remote.upload_rank(scratch, marker)
    store = BucketCheckpoints(layout, remote)
    markers = store.markers(step, attempt, 1)
    store.publish(store.verify_staged(step, markers, False))  # type: ignore[arg-type]


# (a), its neighbour. A restore from the trash writes the step's manifest back and reads its trash record once
#     more; a record gone (a purge running) made it delete the manifest unconditionally. If the purge had deleted
#     the step's objects and the step had been committed again meanwhile (a new attempt, whose manifest replaced the
#     restored one, which committed nothing), that deletion took the new attempt's manifest (b7e80a6: step 2 not
#     committed at the end). It takes back only the object it wrote, as `create_manifest` does.
def test_a_a_restores_take_back_leaves_a_newer_attempts_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.checkpoint.stores import bucket_trash  # noqa: PLC0415

    seen: list[str] = []
    meanwhile: list[Callable[[], None]] = []

    def point(op: str, key: str) -> None:
        seen.append(f"{op} {key}")
        if op == "s3.get" and "/trash/" in key and seen.count(f"{op} {key}") == 2 and meanwhile:
            meanwhile.pop()()  # before the restore's second read of the record

    layout, remote = _memory_remote(tmp_path, monkeypatch, point)
    _commit_in_bucket(layout, remote, 2, "a1")
    assert bucket_trash.retire_step(remote, 2, epoch=1)
    (record,) = [key for _, _, key in bucket_trash.entries(remote)]

    def purge_and_commit_again() -> None:
        remote.store.delete([record])  # a purge: the record first, then the marker, then the objects
        remote.store.delete(sorted(remote.store.listing(remote.attempt_prefix(2, "a1"))))
        _commit_in_bucket(layout, remote, 2, "a2")  # replaces the restored manifest, which commits nothing now

    meanwhile.append(purge_and_commit_again)
    assert not bucket_trash.restore(remote, 2)
    assert not meanwhile, seen  # the interleaving took place
    found = remote.read_manifest(2)
    assert remote.committed() == [2] and found is not None and found[0].attempt == "a2", (remote.committed(), found)


def test_a_a_manifest_is_taken_back_only_as_the_object_its_writer_wrote_on_a_real_server(
    tmp_path: Path, bucket: str, prefix: str
) -> None:
    """On the S3 server of the tests (SeaweedFS): the take-back is a conditional PUT of an empty object, refused
    once the object changed; an empty manifest commits nothing and the step's next commit replaces it."""
    from pipeline.checkpoint.stores.bucket_store import BucketCheckpoints  # noqa: PLC0415
    from tests.s3.helpers import make_remote  # noqa: PLC0415

    layout, remote = make_remote(tmp_path, bucket, prefix)
    _commit_in_bucket(layout, remote, 4, "a1")
    store, key = BucketCheckpoints(layout, remote), remote.manifest_key(4)
    etag = remote.store.head(key).etag
    assert not remote.withdraw_manifest(4, '"0123456789abcdef0123456789abcdef"')  # not the object it wrote
    assert remote.committed() == [4] and store.is_published(4)
    assert remote.withdraw_manifest(4, etag)
    assert remote.store.get(key)[0] == b"" and remote.read_manifest(4) is None
    assert remote.committed() == [] and not store.is_published(4) and store.manifest_hash(4) is None
    assert not remote.withdraw_manifest(4, etag)  # taken back already: that object is gone
    _commit_in_bucket(layout, remote, 4, "a2")
    found = remote.read_manifest(4)
    assert remote.committed() == [4] and found is not None and found[0].attempt == "a2"


# (b) Real. `trash.own_entry` took an entry moved by a *higher* epoch for the purger's own (`>=`), so a lower-epoch
#     ghost purged it at once. Three committers: the ghost (epoch 1) froze as it was about to retire; the live
#     committer (epoch 2) retired step 2 and was killed before purging what it moved; step 4 was damaged; the ghost
#     thawed and purged the live committer's entry at once (a directory's retire purges before its first fence; a
#     bucket's purge after a fence the ghost had passed); the newcomer (epoch 3) that took over from the dead live
#     one had nothing to fall back to. On b7e80a6 the final reader found no step ("none"); now only the entries an
#     epoch moved itself are its own, and step 2 comes back from the newcomer's claim.
def either(*conds: Callable[[World], bool]) -> Callable[[World], bool]:
    return lambda w: any(c(w) for c in conds)


def moved_and_about_to_purge(*act: str) -> Callable[[World], bool]:
    """The live committer has moved steps 2 and 4 to the trash (committing 6) and stands at its own purge of them
    (b7e80a6 purged what it moved at once), or is done with the pass (now: they wait out the grace)."""
    return either(at("live", *act), both(at("live", "sleep 2"), latest_is(6), lambda w: 4 in w.trashed()))


def _b_posix(tmp: Path) -> World:
    return plan(
        Settings(store="posix", steps=(), keep_last=1, live_at=1.0, newcomer_at=5.0),
        tmp,
        run("ghost", until=both(at("ghost", "store.retire"), latest_is(4)), then=lambda w: w.stage_now(2, 4)),
        run("live", until=moved_and_about_to_purge("io rename", ".deleting/.step_2.e2"), then=lambda w: w.stage_now(6)),
        run("ghost", until=ended("ghost"), then=lambda w: (w.kernel.kill(w.kernel.procs["live"]), w.damage(6))),
        run("newcomer", until=ended("newcomer"), then=lambda w: w.finish_writer()),
    )


def _b_bucket(tmp: Path) -> World:
    return plan(
        Settings(store="bucket", steps=(), keep_last=1, live_at=1.0, newcomer_at=5.0),
        tmp,
        run("ghost", until=both(at("ghost", "s3.list", "trash/"), latest_is(4)), then=lambda w: w.stage_now(2, 4)),
        run("live", until=moved_and_about_to_purge("s3.delete", "trash/step_4.e2"), then=lambda w: w.stage_now(6)),
        run("ghost", until=ended("ghost"), then=lambda w: (w.kernel.kill(w.kernel.procs["live"]), w.damage(6))),
        run("newcomer", until=ended("newcomer"), then=lambda w: w.finish_writer()),
    )


@pytest.mark.parametrize("store", ["posix", "bucket"])
def test_b_a_lower_epoch_purges_no_entry_a_higher_epoch_moved_at_once(tmp_path: Path, store: str) -> None:
    w = _b_posix(tmp_path) if store == "posix" else _b_bucket(tmp_path)
    clean(w)
    assert w.ended.get("newcomer") == "done" and w.final_reader[:2] == ("ok", 4), (w.ended, w.final_reader)


# (d) Real (advice only). `Holder.live` compares the holder's heartbeat, written by the holder's wall clock, with
#     the observer's: a committer on a node whose clock is behind by more than its lease looked dead to every poll
#     (the library's resume gave up waiting for a commit that was coming; a job's close stopped waiting), and a dead
#     one whose clock was ahead looked alive for the skew. A caller that polls now keeps a `Watch` across its looks:
#     alive while the record changes within a lease of the observer's own monotonic clock (the first look gives
#     the benefit of the doubt for one lease). On b7e80a6 there was no way to pass one (`committer_running(store)`).
def test_d_a_poller_judges_a_holder_by_its_record_changing_on_its_own_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json  # noqa: PLC0415
    import time  # noqa: PLC0415
    from dataclasses import asdict, replace  # noqa: PLC0415

    from pipeline.checkpoint.protocol import lease_records  # noqa: PLC0415
    from pipeline.checkpoint.stores import stores  # noqa: PLC0415
    from pipeline.checkpoint.stores.posix_store import PosixCheckpoints  # noqa: PLC0415
    from pipeline.storage.layout import CheckpointLayout  # noqa: PLC0415

    clock = [1000.0]  # the observer's monotonic clock
    monkeypatch.setattr(lease_records.time, "monotonic", lambda: clock[0])
    store = PosixCheckpoints(CheckpointLayout(tmp_path / "run"))
    lease = store.lease_store()

    def write(h: lease_records.Holder) -> None:
        lease.put(lease_records.record_name(h.epoch, h.token), json.dumps(asdict(h)).encode(), create=False)

    behind = lease_records.Holder(epoch=1, token="a" * 16, host="gpu-node", pid=4242, job="", started=0.0,
                                  heartbeat=time.time() - 120.0, lease_s=30.0)  # fmt: skip
    write(behind)
    assert not behind.live(time.time()) and not stores.committer_running(store)  # the hole: one wall-clock look
    watch = lease_records.Watch()
    for _ in range(10):  # it renews every 6 s: alive at every poll, however far its clock is behind
        assert stores.committer_running(store, watch)
        clock[0] += 6.0
        behind = replace(behind, beat=behind.beat + 1, heartbeat=behind.heartbeat + 6.0)
        write(behind)
    assert stores.live_holder(store, watch) == behind
    clock[0] += 29.0  # it stops renewing: dead once its record has not changed for a lease of this clock
    assert stores.committer_running(store, watch)
    clock[0] += 1.0
    assert not stores.committer_running(store, watch) and stores.live_holder(store, watch) is None

    ahead = replace(behind, epoch=2, token="b" * 16, beat=0, heartbeat=time.time() + 120.0)  # dead, clock ahead
    write(ahead)
    assert ahead.live(time.time())  # one wall-clock look: alive for the skew (two more minutes)
    watch = lease_records.Watch()
    assert stores.committer_running(store, watch)  # the first look: the benefit of the doubt
    clock[0] += 30.0
    assert not stores.committer_running(store, watch)  # one lease, not the skew
    write(replace(ahead, released=True, beat=1))
    assert not stores.committer_running(store, lease_records.Watch())  # released: dead at the first look


class _Interleave:
    """Installed as the I/O-op plan of :mod:`pipeline.storage.faults`: before the first op whose kind and path
    match each step, that step's act is done (another committer's, while this one was paused there)."""

    def __init__(self, steps: list[tuple[str, str, Callable[[], None]]]) -> None:
        self.steps = steps
        self.trace: list[tuple[str, str]] = []

    def on_op(self, kind: str, path: str) -> None:
        self.trace.append((kind, path))
        if self.steps and self.steps[0][0] == kind and self.steps[0][1] in path:
            self.steps.pop(0)[2]()


# (e) Real. A late quarantine (a ghost's: it checked that step 4 was the copy it found bad, then paused) moved a
#     newer good copy of step 4 to `quarantine/`, saw its manifest was not the one found bad and moved it back;
#     if `checkpoints/step_4` was taken meanwhile (a third copy committed there), the move-back failed silently
#     and the good copy sat in `quarantine/` with its note already removed: `status` said "no quarantine note".
#     It stays in quarantine (the copy at `checkpoints/step_4` is the one readers and retention use; a second
#     copy beside it would be a step of its own to both), with a note saying it is not damaged and that it
#     verifies, shown in one line by `status`, and one line in the log.
def test_e_a_good_copy_a_late_quarantine_cannot_put_back_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import os  # noqa: PLC0415

    from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer  # noqa: PLC0415
    from pipeline.checkpoint.stores import posix_status  # noqa: PLC0415
    from pipeline.checkpoint.stores.posix_store import PosixCheckpoints  # noqa: PLC0415
    from pipeline.storage import faults  # noqa: PLC0415
    from pipeline.storage.layout import CheckpointLayout  # noqa: PLC0415
    from tests.seed_helpers import stage_rank  # noqa: PLC0415

    layout = CheckpointLayout(tmp_path / "run")
    layout.staging.mkdir(parents=True)
    store = PosixCheckpoints(layout)
    step_4, aside = layout.committed_step(4), tmp_path / "aside"
    aside.mkdir()
    copies = {}
    for attempt in ("a1", "a2", "a3"):  # three copies of step 4, each committed in turn and set aside
        stage_rank(layout, 4, 0, world=1, attempt=attempt)  # type: ignore[arg-type]
        Committer(layout, CommitPolicy(world_size=1, marker_deadline_s=5.0), store).commit_ready()
        copies[attempt] = store.manifest_hash(4)
        os.rename(step_4, aside / attempt)
        layout.latest.unlink()
    os.rename(aside / "a1", step_4)  # the copy found bad (a1) is committed

    def found_bad_then_committed_again() -> None:  # the live committer quarantined a1 and committed a2
        os.rename(step_4, aside / "a1-gone")
        os.rename(aside / "a2", step_4)

    plan = _Interleave([
        ("rename", "quarantine/step_4", found_bad_then_committed_again),  # the late quarantine's move
        ("unlink", "quarantine/step_4", lambda: os.rename(aside / "a3", step_4)),  # its move back: a3 is there now
    ])  # fmt: skip
    monkeypatch.setattr(faults._Active, "plan", plan)
    with caplog.at_level(logging.WARNING, "pipeline"):  # another test in this worker may have quieted "pipeline"
        got = store.quarantine(4, None, "a1 found bad", committed=True, manifest_hash=copies["a1"])
    monkeypatch.setattr(faults._Active, "plan", None)

    assert not plan.steps, plan.trace  # the interleaving took place
    assert got is None and store.manifest_hash(4) == copies["a3"]  # not the copy found bad; the newest stays
    (entry,) = posix_status.describe(layout, 1)["quarantined"]
    assert "NOT DAMAGED" in entry.get("reason", "") and "it verifies" in entry["reason"], entry
    assert (Path(entry["path"]) / "manifest.json").is_file() and entry["step"] == 4
    assert [r for r in caplog.records if "stays in quarantine" in r.getMessage()], caplog.text


# (c) Real. The first audit's hole 4 (a ghost's late retention) under a lease view that stays stale: the ghost,
#     frozen at the act that moves step 4 to the trash, thawed after the live committer had fallen back to step
#     4 (steps 6 and 8 damaged); its fence read the lease through a stale view (the listing from before the live
#     committer's record), passed, and it purged its own late entry at once: the step `latest` named was gone (on
#     b7e80a6 the final reader found none, or fell back to an older one). A purge by a process that may be a ghost
#     waits out the grace whatever its fence says: every entry a committer under a lease moved, its own too,
#     stays restorable for `trash.GRACE_S` on its own clock, and the live committer's next pass brings step 4 back.
ACT = {"posix": ("io rename", ".deleting/step_4"), "bucket": ("s3.put", "trash/step_4")}
PURGE = {"posix": "io rename /.deleting/.step_4", "bucket": "s3.delete runs/r1/trash/step_4"}


@pytest.mark.parametrize("store", ["posix", "bucket"])
def test_c_a_ghost_whose_lease_view_is_stale_purges_nothing_at_once(tmp_path: Path, store: str) -> None:
    w = plan(
        Settings(store=store, steps=(), keep_last=2, live_at=1.0),
        tmp_path,
        run("ghost", until=both(at("ghost", *ACT[store]), latest_is(8)), then=lambda w: w.stage_now(4, 6, 8)),
        run("live", until=both(at("live", "sleep 2"), latest_is(4)), then=lambda w: (w.damage(6), w.damage(8))),
        run("ghost", until=at("ghost", "sleep 2"), then=lambda w: w.arm.update(ghost="stale")),  # its fences pass
        run("ghost", until=ended("ghost"), then=lambda w: w.arm.clear()),  # the view is fresh again: it stops
        run("live", then=lambda w: w.finish_writer()),
    )
    clean(w)
    purged = [line for line in w.kernel.trace if "ghost:" in line and PURGE[store] in line]
    assert not purged and w.final_ok == [4] and w.final_reader[:2] == ("ok", 4), (purged, w.final_ok, w.final_reader)
