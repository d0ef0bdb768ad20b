"""The seven ways a ghost committer lost or hid a committed step (issue 33's audit of 79e094b), each replayed
deterministically: the real committers in the simulation (:mod:`tests.sim`), one frozen at a chosen line of its
code while the other runs, the invariants a user relies on checked after every operation. Each of these failed
on 79e094b; the comment of each says how.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.sim.directed import after, any_at, at, committed_before, ended, plan, run
from tests.sim.world import LEASE_S, Settings, World


def latest_is(step: int) -> Callable[[World], bool]:
    return lambda w: w.raw_store().latest_named() == step


def both(*conds: Callable[[World], bool]) -> Callable[[World], bool]:
    return lambda w: all(c(w) for c in conds)


def either(*conds: Callable[[World], bool]) -> Callable[[World], bool]:
    return lambda w: any(c(w) for c in conds)


def graced(w: World) -> bool:
    """What was retired at the start has stayed in the trash for its grace (virtual time)."""
    from pipeline.checkpoint.protocol.trash import GRACE_S  # noqa: PLC0415

    return w.kernel.now > GRACE_S + 5


def again(w: World) -> None:
    """The writer after a repair: step 4 saved again (a new attempt), then step 6."""
    w.stage_now(4, attempt="a2")
    w.stage_now(6)


def clean(w: World) -> None:
    assert not w.violations, w.violations
    errors = [f"{a.name}: {a.error!r}" for a in w.kernel.actors if a.error is not None]
    assert not errors, errors


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


# 1. An unreadable lease counted as free: the ghost's fence read "no holder" and wrote its own epoch-1 record over
#    the live committer's epoch 2 (79e094b: "the lease went back from epoch 2 to 1").
@pytest.mark.parametrize("store", ["posix", "bucket"])
def test_a_ghost_that_cannot_read_the_lease_has_lost_it(tmp: Path, store: str) -> None:
    w = plan(
        Settings(store=store, steps=(), live_at=1.0),
        tmp,
        run("ghost", until=at("ghost", "sleep 2"), then=lambda w: w.stage_now(2)),
        run("live", until=at("live", "sleep 2")),
        run("ghost", until=ended("ghost"), then=lambda w: w.arm.update(ghost="unreadable")),
        run("live", then=lambda w: w.finish_writer()),
    )
    clean(w)
    assert w.ended["ghost"] == "lost" and w.ended["live"] == "done", w.ended


# 2. A release (read, then write) landed over the newer holder's record: a plain commit was then admitted beside
#    the live committer (79e094b: "the lease went back from epoch 2 to 1").
@pytest.mark.parametrize("store", ["posix", "bucket"])
def test_a_ghosts_late_release_leaves_the_live_holder_holding(tmp: Path, store: str) -> None:
    w = plan(
        Settings(store=store, steps=(), ghost_passes=1, live_at=1.0, newcomer_at=30.0),
        tmp,
        run(
            "ghost",
            until=both(latest_is(2), either(at("ghost", "lease.put"), at("ghost", "lease.write"))),
            then=lambda w: w.stage_now(2),
        ),  # fmt: skip
        run("live", until=at("live", "sleep 2")),
        run("ghost", until=ended("ghost")),
        run("live", "newcomer", until=ended("newcomer")),
        run("live", then=lambda w: w.finish_writer()),
    )
    clean(w)
    assert w.ended["newcomer"] == "refused" and w.ended["live"] == "done", w.ended


# 3. A ghost's pending `latest = 6` landed after the live committer committed 8 and retired 6 (keep_last=1): every
#    reader failed (79e094b: "latest names step 6, but step_6/manifest.json is missing").
def test_a_ghosts_late_latest_to_a_retired_step_stops_no_reader(tmp: Path) -> None:
    w = plan(
        Settings(store="posix", steps=(), keep_last=1, live_at=1.0),
        tmp,
        run(
            "ghost",
            until=both(at("ghost", "io create", "latest.tmp"), lambda w: w.layout.committed_step(6).exists()),
            then=lambda w: w.stage_now(2, 4, 6),
        ),  # fmt: skip
        run("live", until=both(at("live", "sleep 2"), latest_is(8)), then=lambda w: w.stage_now(8)),
        run("ghost", until=ended("ghost")),
        run("live", then=lambda w: w.finish_writer()),
    )
    clean(w)
    assert w.ended["ghost"] == "lost" and not w.layout.quarantine.exists(), w.ended  # nothing taken for damage


# 4. A ghost's retention, decided before a pause, removed the step the live committer had just fallen back to
#    (steps 6 and 8 damaged): the only good checkpoint was gone (79e094b: "step 4 verified and was removed").
@pytest.mark.parametrize("store", ["posix", "bucket"])
def test_a_ghosts_stale_retention_spares_the_step_latest_fell_back_to(tmp: Path, store: str) -> None:
    w = plan(
        Settings(store=store, steps=(), keep_last=2, live_at=1.0),
        tmp,
        run("ghost", until=both(at("ghost", "store.retire"), latest_is(8)), then=lambda w: w.stage_now(4, 6, 8)),
        run("live", until=both(at("live", "sleep 2"), latest_is(4)), then=lambda w: (w.damage(6), w.damage(8))),
        run("ghost", until=ended("ghost")),
        run("live", then=lambda w: w.finish_writer()),
    )
    clean(w)
    assert w.ended["ghost"] == "lost" and w.final_ok == [4], (w.ended, w.final_ok)


# 4b. The same ghost frozen after its re-check, at the act itself (a directory's rename into the trash; in a
#     bucket, the deletion of the manifest it just copied to the trash): the step goes to the trash, a reader is
#     told to resume again (never given an older step), and the live committer's next pass brings it back.
@pytest.mark.parametrize(
    ("store", "act"), [("posix", ("io rename", ".deleting/step_4")), ("bucket", ("s3.delete", "step_4/manifest.json"))]
)
def test_a_step_a_ghost_moved_to_the_trash_late_comes_back(tmp: Path, store: str, act: tuple[str, str]) -> None:
    w = plan(
        Settings(store=store, steps=(), keep_last=2, live_at=1.0),
        tmp,
        run("ghost", until=both(at("ghost", *act), latest_is(8)), then=lambda w: w.stage_now(4, 6, 8)),
        run("live", until=both(at("live", "sleep 2"), latest_is(4)), then=lambda w: (w.damage(6), w.damage(8))),
        run("ghost", until=ended("ghost")),
        run("live", then=lambda w: w.finish_writer()),
    )
    clean(w)
    assert w.final_ok == [4] and w.final_reader[:2] == ("ok", 4), (w.final_ok, w.final_reader)


# 5. `recheck_latest` verified step 4 (damaged), fenced, paused; the live committer repaired, committed 4' and 6;
#    the ghost then quarantined whatever `latest` named (the good step 6) with step 4's reason and moved `latest`
#    back (79e094b: "step 6 verified and was removed").
def test_a_ghost_quarantines_only_the_copy_it_found_bad(tmp: Path) -> None:
    w = plan(
        Settings(store="posix", steps=(), keep_last=3, live_at=1.0),
        tmp,
        run(
            "ghost",
            until=either(at("ghost", "store.latest_named"), at("ghost", "store.quarantine")),
            then=lambda w: w.damage(4),
        ),  # fmt: skip
        run("live", until=both(at("live", "sleep 2"), latest_is(2))),
        run("live", until=both(at("live", "sleep 2"), latest_is(6)), then=again),
        run("ghost", until=ended("ghost")),
        run("live", then=lambda w: w.finish_writer()),
        prepare=committed_before(2, 4),
    )
    clean(w)
    assert w.final_ok == [2, 4, 6] and w.final_reader[:2] == ("ok", 6), (w.final_ok, w.final_reader)


# 6. In a bucket, a ghost paused in its fall-back's re-read of step 2 moved `latest` back to 2 after the live
#    committer committed 4' and 6, and readers (who trusted `latest` as written) resumed from 2 (79e094b: "latest
#    went back from step 6 to 2").
def test_a_ghosts_late_fall_back_in_a_bucket_takes_no_reader_back(tmp: Path) -> None:
    w = plan(
        Settings(store="bucket", steps=(), keep_last=3, live_at=1.0),
        tmp,
        run("ghost", until=at("ghost", "s3.list", "step_2/a1/"), then=lambda w: w.damage(4)),
        run("live", until=both(at("live", "sleep 2"), latest_is(2))),
        run("live", until=both(at("live", "sleep 2"), latest_is(6)), then=again),
        run("ghost", until=ended("ghost")),
        run("live", until=at("live", "sleep 2")),
        run("live", then=lambda w: w.finish_writer()),
        prepare=committed_before(2, 4),
    )
    clean(w)
    assert w.final_reader[:2] == ("ok", 6) and w.final_latest == 6, (w.final_reader, w.final_latest)


# 6b. In a bucket, a ghost paused just before writing step 4's manifest wrote it after the live committer had
#     committed 4 and 6 and retired 4 (its objects purged): with step 6 damaged, readers fell back to a step 4
#     whose objects were gone (found by the 100,000-schedule run). Retention's purge deletes the rank 0 marker
#     first and a manifest counts only beside it; the ghost takes its late manifest back. (A retired step is
#     purged once it has stayed in the trash for the grace: the live committer purges step 4 when it commits 8.)
def test_a_ghosts_late_manifest_of_a_purged_step_commits_nothing(tmp: Path) -> None:
    w = plan(
        Settings(store="bucket", steps=(), keep_last=1, live_at=1.0, newcomer_at=5.0),
        tmp,
        run("ghost", until=at("ghost", "s3.put", "step_4/manifest.json"), then=lambda w: w.stage_now(2, 4)),
        run("live", until=both(at("live", "sleep 2"), latest_is(6), graced), then=lambda w: w.stage_now(6)),
        run("live", until=both(at("live", "sleep 2"), latest_is(8)), then=lambda w: w.stage_now(8)),
        run("ghost", until=ended("ghost"), then=lambda w: w.damage(8)),
        run("live", until=ended("live"), then=lambda w: w.finish_writer()),
        run("newcomer", until=ended("newcomer")),  # quarantines step 8: what do readers fall back to?
    )
    clean(w)
    assert 4 not in w.final_ok and w.final_reader[:2] == ("ok", 6), (w.final_ok, w.final_reader)


# 6c. In a bucket, a ghost's late retention left a trash record of step 2; the live committer brought step 2
#     back, committed 6, retired 2 again and purged its own record, deleting the objects the ghost's record still
#     listed: the next fall-back (a rerun, step 6 damaged, the ghost dead) brought back a step 2 without its
#     objects (found by the 100,000-schedule run).
def test_a_purge_spares_objects_another_trash_record_lists(tmp: Path) -> None:
    w = plan(
        Settings(store="bucket", steps=(), keep_last=1, live_at=1.0),
        tmp,
        run(
            "ghost",
            until=both(at("ghost", "s3.list", "trash/"), lambda w: w.raw_store().committed() == [4]),
            then=lambda w: w.stage_now(2, 4),
        ),  # fmt: skip
        run("live", until=both(at("live", "sleep 2"), latest_is(2)), then=lambda w: w.damage(4)),
        run("live", until=both(at("live", "sleep 2"), latest_is(6)), then=lambda w: w.stage_now(6)),
        run("live", then=lambda w: (w.kernel.kill(w.kernel.procs["ghost"]), w.damage(6), w.finish_writer())),
    )
    clean(w)
    assert w.final_ok == [2] and w.final_reader[:2] == ("ok", 2), (w.final_ok, w.final_reader)


# 7c. A newcomer paused after confirming its record (deleting the records below it) while the appointed
#     committer took over at a higher epoch: it came back admitted beside that live holder (found by the
#     100,000-schedule run). Acquisition ends with a fence: fenced meanwhile, it is refused.
@pytest.mark.parametrize("store", ["posix", "bucket"])
def test_a_newcomer_fenced_while_it_acquired_is_refused(tmp: Path, store: str) -> None:
    w = plan(
        Settings(store=store, steps=(), ghost_passes=1, live_at=3.0, newcomer_at=2.0),
        tmp,
        run("ghost", until=ended("ghost"), then=lambda w: w.stage_now(2)),
        run("newcomer", until=at("newcomer", "lease.delete")),
        run("live", until=at("live", "sleep 2")),
        run("newcomer", until=ended("newcomer")),
        run("live", then=lambda w: w.finish_writer()),
    )
    clean(w)
    assert w.ended["newcomer"] == "refused" and w.ended["live"] == "done", w.ended


# 7. Liveness compared wall clocks across nodes: a holder whose clock is behind was taken for dead (a second
#    committer admitted beside it); one on another node with the same hostname was declared dead by a pid check.
@pytest.mark.parametrize("how", ["clock behind", "same hostname"])
def test_a_renewing_holder_on_another_node_is_never_taken_for_dead(tmp: Path, how: str) -> None:
    s = Settings(store="posix", steps=(2, 4, 6, 8, 10), write_every=4.0, ghost=False, live_at=0.5, newcomer_at=5.0)
    if how == "clock behind":
        s.skews = {"live": -120.0}
    else:
        s.hosts = {"live": "gpu-node", "newcomer": "gpu-node"}
    w = plan(s, tmp)
    clean(w)
    assert w.ended["newcomer"] == "refused" and w.ended["live"] == "done", w.ended


# 7b. ... and a dead holder whose clock ran ahead blocked newcomers for the skew (two minutes here); a newcomer
#     now takes over once the record has not changed for one lease on its own clock.
def test_a_dead_holder_with_a_clock_ahead_is_taken_over_after_one_lease(tmp: Path) -> None:
    s = Settings(store="posix", steps=(2, 4), write_every=2.0, ghost=False, live_at=0.5, newcomer_at=5.0)
    s.skews = {"live": 120.0}
    w = plan(
        s,
        tmp,
        run("live", "writer", until=lambda w: w.kernel.now >= 3.0),
        run("newcomer", "writer", until=ended("newcomer"), then=lambda w: w.kernel.kill(w.kernel.procs["live"])),
    )
    clean(w)
    assert w.ended["newcomer"] == "done", w.ended
    assert w.acquired["newcomer"] < 5.0 + LEASE_S + 10, f"taken over at t={w.acquired['newcomer']:.0f} s"


def test_any_at_finds_a_heartbeat(tmp: Path) -> None:
    """The plans above name the points of the real code they freeze at; one of them, seen at all."""
    w = plan(
        Settings(store="posix", steps=(2,), live_at=None), tmp, run("ghost", "writer", until=any_at("ghost", "lease."))
    )
    assert any("lease." in a.at for a in w.kernel.procs["ghost"].actors) or w.ended, w.ended
    assert after(lambda _w: True, lambda _w: True)(w)


# 8. Found by the 100,000-schedule run (bucket, seed 20041559 on 38b89b5), in both stores: a committer retired step 2
#    (keep_last=1, step 4 committed) and, frozen between its fence and its purge's first act, came back after step 4
#    was damaged and the appointed committer had quarantined it; its late purge took the retired step the fall-back
#    needed. A directory: a new holder first renames what lower epochs left in the trash under its own epoch, so the
#    late purge's rename finds nothing. A bucket: open (no delete conditional on another object). (A retired step is
#    purged once it has stayed in the trash for the grace: the ghost purges step 2 when it commits 6, and steps 4
#    and 6 are both damaged.)
PURGE = {"bucket": ("s3.delete", "trash/step_2"), "posix": ("io rename", ".deleting/.step_2")}


@pytest.mark.parametrize("store", ["posix", "bucket"])
def test_a_late_purge_of_a_retired_step_leaves_the_step_a_fall_back_needs(tmp: Path, store: str) -> None:
    w = plan(
        Settings(store=store, steps=(), keep_last=1, live_at=1.0),
        tmp,
        run("ghost", until=graced, then=lambda w: w.stage_now(2, 4)),
        run("ghost", until=at("ghost", *PURGE[store]), then=lambda w: w.stage_now(6)),
        run("live", until=at("live", "store.trashed"), then=lambda w: (w.damage(4), w.damage(6))),
        run("ghost", until=ended("ghost")),
        run("live", then=lambda w: w.finish_writer()),
    )
    clean(w)
    assert w.final_reader[:2] == ("ok", 2), (w.final_ok, w.final_reader)


@pytest.mark.parametrize("token", ["0" * 16, "f" * 16])  # below and above the released record's: either way
def test_an_appointed_committer_whose_listing_missed_its_epoch_takes_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token: str
) -> None:
    """A stale listing (a shared mount's view) showed the appointed committer no record, so it chose epoch 1, which
    a released holder already had. Its confirmation finds that record and it takes epoch 2, above every record, so
    a newcomer of epoch 2 whose write lands late yields to it (found as seed 1004975, bucket)."""
    from pipeline.checkpoint.protocol import ownership  # noqa: PLC0415

    store = ownership.FileLease(tmp_path / "committer")
    before = ownership.CommitterLease(store, lease_s=30)
    before.acquire()
    before.release()
    real, listings = ownership.ranked, []

    def stale_first(s: ownership.LeaseStore) -> list[tuple[int, str, str]]:
        listings.append(s)
        return [] if len(listings) == 1 else real(s)

    monkeypatch.setattr(ownership, "ranked", stale_first)
    live = ownership.CommitterLease(store, lease_s=30)
    live.token = token
    live.acquire(takeover=True)
    try:
        records = real(store)
        assert live.epoch == 2 and (records[-1][0], records[-1][1]) == (2, live.token), records
        assert [r[0] for r in records if r[1] != live.token] == [1]  # the released record, below it
    finally:
        live.release()
