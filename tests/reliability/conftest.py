"""Shared by the reliability suite: its size knob and the scenario table printed at the end of the run.

``RELIABILITY_SCALE`` sets the size: ``ci`` (default, about ten minutes on 2 cores) or ``large`` (the figures
of the closing note). Each scenario test records one row with :func:`record`; the table is printed in the
terminal summary, one line per scenario with its figure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from tests.reliability import harness

SCALE = os.environ.get("RELIABILITY_SCALE", "ci")
if SCALE not in ("ci", "large"):
    raise pytest.UsageError(f"RELIABILITY_SCALE={SCALE!r}: use ci (default) or large")


@pytest.fixture(scope="session", autouse=True)
def _one_base_run_per_session(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The base run (``harness.base_run``: a full launch) made once per session: under pytest-xdist, in the
    directory above the workers' own temp dirs, which they all see; alone, in the session's temp dir."""
    basetemp = tmp_path_factory.getbasetemp()
    harness.share_base_run_in(basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp)


def sized(ci: int, large: int) -> int:
    """A count for this scale: ``ci`` by default, ``large`` with RELIABILITY_SCALE=large."""
    return large if SCALE == "large" else ci


@dataclass
class Row:
    scenario: str
    figure: str
    ok: bool
    notes: list[str] = field(default_factory=list)


ROWS: list[Row] = []
"""Rows recorded in this process and not yet attached to a test report (the table is printed by
``tests/conftest.py``, from the reports: in the controlling process too under pytest-xdist)."""


def record(scenario: str, figure: str, *, ok: bool, notes: list[str] | None = None) -> None:
    """One line of the scenario table: a name, its figure, and whether the figure met its target."""
    ROWS.append(Row(scenario, figure, ok, list(notes or [])))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """Rows recorded during a test travel with its report (to the controlling process under pytest-xdist)."""
    before = len(ROWS)
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    for row in ROWS[before:]:
        report.user_properties.append(("reliability_row", (row.scenario, row.figure, row.ok, row.notes)))
    del ROWS[before:]
    return None
