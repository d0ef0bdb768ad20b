"""Deadline-bounded polling with a liveness check (no wait in this project is unbounded)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from pipeline.errors import DeadlineError

T = TypeVar("T")


def wait_until(
    poll: Callable[[], T | None],
    *,
    deadline_s: float,
    what: Callable[[], str],
    alive: Callable[[], bool] = lambda: True,
    interval_s: float = 0.2,
) -> T:
    """Call ``poll`` until it returns non-None.

    Fails with :class:`DeadlineError` when ``deadline_s`` passes, or as soon as ``alive()`` turns false and a
    last poll still finds nothing (what we wait for can no longer arrive). ``what()`` describes what is
    still missing, e.g. the ranks whose markers are absent, and goes into the error.
    """
    start = time.monotonic()
    while True:
        result = poll()
        if result is not None:
            return result
        if not alive():
            result = poll()
            if result is not None:
                return result
            raise DeadlineError(f"gave up waiting: the producer is no longer running; still missing: {what()}")
        if time.monotonic() - start > deadline_s:
            raise DeadlineError(f"deadline of {deadline_s:g}s passed; still missing: {what()}")
        time.sleep(interval_s)
