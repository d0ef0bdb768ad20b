"""``settled_states``, the tests' read of a finished job's SLURM state, against a faked accounting sequence: no
cluster needed (the fixture is not used)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest

from tests.slurm.conftest import Expected, settled_states


class FakeAccounting:
    """``read`` answers each call with the next row of ``answers`` (the last one forever); a fake clock that
    ``sleep`` advances."""

    def __init__(self, answers: Iterable[dict[str, str]]) -> None:
        self.answers = list(answers)
        self.reads = 0
        self.now = 0.0

    def read(self, ids: list[str]) -> dict[str, str]:
        answer = self.answers[min(self.reads, len(self.answers) - 1)]
        self.reads += 1
        return {k: v for k, v in answer.items() if k in ids}

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s

    def settled(
        self, ids: list[str], expect: Expected | Mapping[str, Expected] | None = None, **kw: float
    ) -> dict[str, str]:
        return settled_states(ids, expect, read=self.read, clock=self.clock, sleep=self.sleep, **kw)


def test_a_premature_failed_is_read_again_until_accounting_says_completed() -> None:
    """The flake seen in test_submitit_runs_a_function: the job returned 49, sacct said FAILED, then COMPLETED."""
    acct = FakeAccounting([{"7": "FAILED"}] * 5 + [{"7": "COMPLETED"}])
    assert acct.settled(["7"], "COMPLETED", timeout_s=60, stable_s=2) == {"7": "COMPLETED"}
    assert acct.reads > 6  # read again past the FAILED, then for stable_s more


def test_a_running_or_unknown_job_is_not_settled_and_a_flapping_state_must_hold_still() -> None:
    acct = FakeAccounting([{}, {"7": "RUNNING"}, {"7": "COMPLETING"}, {"7": "COMPLETED"}, {"7": "FAILED"}])
    # no expectation: any end state, once it reads the same for stable_s
    assert acct.settled(["7"], timeout_s=60, stable_s=2) == {"7": "FAILED"}


def test_expectations_per_job_and_alternatives() -> None:
    acct = FakeAccounting([{"1": "COMPLETED", "2": "FAILED", "3": "CANCELLED"}])
    got = acct.settled(["1", "2", "3"], {"2": ("COMPLETED", "FAILED"), "3": "CANCELLED"}, stable_s=1)
    assert got == {"1": "COMPLETED", "2": "FAILED", "3": "CANCELLED"}


def test_a_state_that_never_settles_fails_at_the_deadline_naming_what_was_seen() -> None:
    acct = FakeAccounting([{"7": "RUNNING"}, {"7": "FAILED"}])
    with pytest.raises(AssertionError) as err:
        acct.settled(["7"], "COMPLETED", timeout_s=30, stable_s=2)
    message = str(err.value)
    assert "within 30 s" in message and "job 7: FAILED, expected COMPLETED (seen: RUNNING -> FAILED)" in message
    assert 30 <= acct.now <= 31  # bounded: it gave up at the deadline
