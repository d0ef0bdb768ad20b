"""Reading a small file that another node replaces (write temp, fsync, rename over it) through a shared mount.

A FUSE client of a shared filesystem (SeaweedFS ``weed mount``, measured in ``scripts/cluster``: 218 of the
reads in 10 s while another node replaced the file every 20 ms) can return the new content cut to the old
file's cached size, or with the old tail: the bytes are not one version of the file. A re-read ~10 ms later
gets the whole new file (every one of those 218). So a reader that finds a record it cannot parse reads it again
a few times, briefly, before it calls it damaged; what it finally parses is one whole version, old or new.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

REREAD_DELAYS_S = (0.01, 0.05, 0.2, 0.5, 1.0)
"""Pauses before each re-read of a record that did not parse (1.76 s in all, then it is damaged): a torn read of
``latest`` through a FUSE mount was seen whole again within 1 s."""


def parse_settled(read: Callable[[], bytes], parse: Callable[[bytes], T], torn: tuple[type[Exception], ...]) -> T:
    """``parse(read())``; where it raises one of ``torn``, read and parse again after each of
    :data:`REREAD_DELAYS_S`; the last failure propagates."""
    for delay in REREAD_DELAYS_S:
        try:
            return parse(read())
        except torn:
            time.sleep(delay)
    return parse(read())
