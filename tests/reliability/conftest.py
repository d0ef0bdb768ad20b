"""Shared by the reliability suite: its size knob and the scenario table printed at the end of the run.

``RELIABILITY_SCALE`` sets the size: ``ci`` (default, about ten minutes on 2 cores) or ``large`` (the figures
of the closing note). Each scenario test records one row with :func:`record`; the table is printed in the
terminal summary, one line per scenario with its figure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

SCALE = os.environ.get("RELIABILITY_SCALE", "ci")
if SCALE not in ("ci", "large"):
    raise pytest.UsageError(f"RELIABILITY_SCALE={SCALE!r}: use ci (default) or large")


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


def record(scenario: str, figure: str, *, ok: bool, notes: list[str] | None = None) -> None:
    """One line of the scenario table: a name, its figure, and whether the figure met its target."""
    ROWS.append(Row(scenario, figure, ok, list(notes or [])))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not ROWS:
        return
    tr = terminalreporter
    tr.section(f"reliability scenarios (RELIABILITY_SCALE={SCALE})")
    width = max(len(r.scenario) for r in ROWS)
    for r in ROWS:
        tr.write_line(f"{'ok  ' if r.ok else 'FAIL'} {r.scenario:<{width}}  {r.figure}")
        for note in r.notes[:5]:
            tr.write_line(f"       {note}")
