"""The CPU each test costs: its process's and its reaped children's (the pipeline's jobs and ranks), from setup to
teardown. On 2 cores the suite is bound by CPU, not by how long tests wait, so this, not ``--durations``, says
which tests to make cheaper. The terminal summary lists the costliest; ``PIPELINE_CPU_CENSUS=FILE`` also writes
every test's figure there, one JSON line each. (Processes a test does not reap, such as SLURM's jobs on the
test cluster, are not counted.)"""

from __future__ import annotations

import json
import os
import resource

import pytest

SHOWN = 15
_started: dict[str, float] = {}
_costs: list[tuple[float, str]] = []


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _started[item.nodeid] = _cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    if call.when == "teardown" and item.nodeid in _started:
        outcome.get_result().user_properties.append(("cpu_s", _cpu() - _started.pop(item.nodeid)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == "cpu_s" and report.when == "teardown":
            _costs.append((float(value), report.nodeid))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _costs:
        return
    total = sum(c for c, _ in _costs)
    terminalreporter.section(f"CPU per test (its process and reaped children; {total / 60:.0f} CPU-min in all)")
    for cost, nodeid in sorted(_costs, reverse=True)[:SHOWN]:
        terminalreporter.write_line(f"{cost:8.1f}s  {nodeid}")
    path = os.environ.get("PIPELINE_CPU_CENSUS")
    if path:
        with open(path, "w") as f:
            for cost, nodeid in sorted(_costs, reverse=True):
                f.write(json.dumps({"cpu_s": round(cost, 2), "test": nodeid}) + "\n")
