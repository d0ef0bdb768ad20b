"""The commit protocol explored by the deterministic simulation (:mod:`tests.simulate`): random schedules of a
writer, a ghost, a live committer and a newcomer on both stores, faults anywhere, every invariant checked after
every operation; and a small configuration explored exhaustively to a stated depth."""

from __future__ import annotations

import os

import pytest

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
