"""The commit protocol explored by the deterministic simulation (:mod:`tests.simulate`): random schedules of a
writer, a ghost, a live committer and a newcomer on both stores, faults anywhere, every invariant checked after
every operation; and a small configuration explored exhaustively to a stated depth."""

from __future__ import annotations

import os

import pytest

from tests.simulate import STORES, exhaustive, explore, small

SCHEDULES = int(os.environ.get("SIM_SCHEDULES", "5000"))
"""Schedules per store in the suite, 10,000 over both (``python -m tests.simulate --schedules N`` for more)."""
CHUNKS = 4


@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("store", STORES)
def test_random_schedules_break_no_invariant(store: str, chunk: int) -> None:
    first = 1_000_000 * (chunk + 1)  # other seeds than a default command-line run
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
