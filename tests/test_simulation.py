"""The commit protocol explored by the deterministic simulation (:mod:`tests.simulate`): random schedules of a
writer, a ghost, a live committer and a newcomer on both stores, faults anywhere, every invariant checked after
every operation; and a small configuration explored exhaustively to a stated depth."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sim import damage as harm
from tests.sim.directed import at, committed_before, plan, run
from tests.sim.world import Settings
from tests.simulate import STORES, exhaustive, explore, small

SCHEDULES = int(os.environ.get("SIM_PYTEST_SCHEDULES", "500"))
"""Schedules per store here, a regression check for a plain ``pytest``: ``scripts/test.sh`` runs the 10,000 of the
test command before pytest, on both cores (``python -m tests.simulate --schedules 10000 --first-seed 1000000``)."""
CHUNKS = 2


@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("store", STORES)
def test_random_schedules_break_no_invariant(store: str, chunk: int) -> None:
    first = 100_000 * (chunk + 1)  # other seeds than the test command's (1,000,000 on) and a default run's (0 on)
    tally = explore(store, range(first, first + SCHEDULES // CHUNKS), workers=1)
    assert tally.schedules == SCHEDULES // CHUNKS
    assert sum(tally.faults.values()) > tally.schedules // 2, tally.faults  # faults were injected
    assert not tally.failed, [f"seed {s} ({st}): {what} (replay: python -m tests.simulate --replay {s} --store {st})"
                              for s, st, what in tally.failed[:5]]  # fmt: skip


@pytest.mark.parametrize("store", STORES)
def test_a_small_configuration_explored_exhaustively(store: str) -> None:
    """Two committers (the ghost and the live one), two steps, every choice of the first 5 of the schedule: which
    process runs, and whether the one about to act is paused for a whole lease there."""
    runs, failed = exhaustive(store, 5, small(store))
    assert runs > 20
    assert not failed, failed[:3]


@pytest.mark.parametrize(
    ("seed", "store"),
    [
        (40002071, "posix"),  # a failed bring-back (EIO) removed latest: nothing redid it
        (40002604, "posix"),  # a rank's closing fsync of its staged step failed: the committer had published the step
        (1004975, "bucket"),  # an appointed committer took a held epoch (stale listing)
        (5009, "posix"),  # a step renamed into place, its manifest not yet written: a resuming trainer saw no step
    ],
)
def test_schedules_that_found_a_gap_now_pass(seed: int, store: str) -> None:
    """Schedules that broke an invariant on f88d5db, or (5009) the resume invariant on fd44fd8 (``python -m
    tests.simulate --replay SEED --store STORE``)."""
    from tests.sim.world import run_one  # noqa: PLC0415

    w = run_one(seed, store)
    assert not w.violations, w.violations


# -- found by the read faults and record damage of issue 48 (tests.sim.read_faults, tests.sim.damage) ----------------


@pytest.mark.parametrize("garbage", [True, False], ids=["garbage", "wrong hash"])
@pytest.mark.parametrize("record", ["manifest", "latest"])
@pytest.mark.parametrize("store", STORES)
def test_a_damaged_manifest_or_latest_is_repaired_and_latest_falls_back_no_further(
    tmp_path: Path, store: str, record: str, garbage: bool
) -> None:
    """Steps 2 and 4 committed, then step 4's manifest or ``latest`` overwritten in place (garbage, or a recorded
    hash changed): positive damage. A committer repairs it: a damaged manifest's copy is quarantined and ``latest``
    falls back to 2 (a bucket's garbage manifest alone goes aside, and its intact attempt is committed again: 4);
    a damaged ``latest`` is rebuilt at 4 (nothing else was damaged). Found as seeds 59, 67, 125,
    146 (a manifest) and 1611 (``latest``, a wrong hash; posix): ``latest_repair._repair_pointer`` asked
    ``store.newest()``, which for a directory raises the same VerificationError (``latest`` names a step whose
    manifest differs), so every committer, the rerun's too, ended on it and nothing was ever repaired."""
    where = 4 if record == "manifest" else str(latest_of(store, tmp_path))
    w = plan(
        Settings(store=store, steps=(), ghost=False, live_at=1.0),
        tmp_path,
        run("live", then=lambda w: (harm.damage(w, record, where, garbage), w.finish_writer())),
        prepare=committed_before(2, 4),
    )
    assert not w.violations, w.violations
    assert w.ended.get("live") == "done", w.ended
    # a bucket's manifest past reading goes aside alone: its attempt, intact, is verified from its markers and
    # committed again; a manifest that reads but lists a wrong hash takes its copy to quarantine
    again = record != "manifest" or (store == "bucket" and garbage)
    assert w.final_reader[:2] == ("ok", 4 if again else 2), w.final_reader


def latest_of(store: str, tmp_path: Path) -> str:
    """Where ``latest`` is in a world built in ``tmp_path`` (a key of the bucket, or a path)."""
    return f"{harm.ROOT}/latest" if store == "bucket" else str(tmp_path / "run" / "checkpoints" / "latest")


def test_a_quarantine_of_a_damaged_committed_copy_leaves_a_new_attempt_staged_beside_it(tmp_path: Path) -> None:
    """A bucket: step 6's committed copy (attempt a1) has a damaged manifest, and the restarted job saved step 6
    again as attempt a2 (its reader skipped the damaged manifest and resumed from 4). A resuming trainer waits for
    a2, the committer quarantines the a1 copy and commits a2: a reader then resumes from 6. Found as seed 827
    (bucket), two gaps: ``stores.uncommitted`` counts step 6 as committed (a manifest is there, damaged), so a
    resuming trainer starts from 4 and never waits for a2; and ``BucketRemoval.quarantine`` of the committed step
    moved every attempt under ``step_6/`` to quarantine, the a2 copy no one had verified or damaged with it, so
    readers went back to 4 for good."""
    w = plan(
        Settings(store="bucket", steps=(), ghost=False, live_at=1.0, world=2),
        tmp_path,
        run(
            "live",
            then=lambda w: (
                harm.damage(w, "manifest", 6, True),
                w.stage_now(6, attempt="a2"),
                w.finish_writer(),
            ),
        ),
        prepare=committed_before(2, 4, 6),
    )
    assert not w.violations, w.violations
    assert w.final_reader[:2] == ("ok", 6), w.final_reader


@pytest.mark.parametrize(("store", "err"), [("bucket", "timeout"), ("bucket", "5xx"), ("posix", "EIO")])
def test_a_store_that_fails_the_resumes_reads_stops_the_trainer_in_one_line(
    tmp_path: Path, store: str, err: str
) -> None:
    """A restarted training job's rank 0 decides where to resume (``resume.decide``) while its reads of the store
    fail for 25 s (a bucket: a timeout of every request, or a 5xx: the client's own retries spent; a directory:
    ``EIO`` of the mount). It must not resume from an older step, nor raise: rank 0 returns why it cannot decide,
    which every rank raises (a rank 0 that raises instead leaves the other ranks waiting in the broadcast). Found
    as seeds 55 and 133 (bucket, with SIM_SKIP=damage-manifest): the ``StoreError`` of the LIST in
    ``stores.uncommitted`` escaped ``resume.decide``, whose wait catches only ``DeadlineError`` and ``ReadFailed``."""
    w = plan(
        Settings(store=store, steps=(2,), ghost=False, live_at=None, restart_at=0.0, write_every=1.0),
        tmp_path,
        run("writer", "restart", until=at("writer", "restart.recovered")),
        run("restart", "writer", then=lambda w: w.readf.begin_burst("writer", err, 25.0, None)),
        prepare=committed_before(2),
    )
    assert not w.violations, w.violations
    assert len(w.resumes) == 1 and w.resumes[0].startswith("cannot resume"), w.resumes


def test_one_failed_read_of_latests_manifest_stops_no_resume_with_a_traceback(tmp_path: Path) -> None:
    """Step 2 committed (and staged again by the restarted writer); rank 0 of the restarted job decides where to
    resume, and the second time it hashes ``step_2/manifest.json`` (after the wait for staged steps) the read fails
    once with ``ESTALE``. A read that fails is retried, or the resume fails in one line; it never raises. Found as seed
    6222 (posix; 6473 in a bucket, the pulled copy's manifest): ``manifest.read_latest`` hashes the manifest with
    ``hash_file``, outside ``reads.retrying``, and ``resume.decide`` catches only ``PipelineError`` there: the
    ``OSError`` escaped rank 0's decision."""
    manifest = str(tmp_path / "run" / "checkpoints" / "step_2" / "manifest.json")
    w = plan(
        Settings(store="posix", steps=(2,), ghost=False, live_at=None, restart_at=0.0, write_every=1.0),
        tmp_path,
        run("writer", "restart", until=at("writer", "restart.recovered")),
        run(
            "restart",
            "writer",
            then=lambda w: w.readf.begin_burst("writer", "ESTALE", 0.0, manifest, skip=1, only="data"),
        ),
        prepare=committed_before(2),
    )
    assert not w.violations, w.violations
    assert w.resumes == ["step 2"] or w.resumes[0].startswith("cannot resume"), w.resumes
