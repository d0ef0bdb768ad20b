"""Reads that fail are unknown, not damage (``docs/design.md``, "Unknown is not damage").

A shared filesystem fails reads that a local disk never fails: a FUSE client returns ``EIO`` (or ``ENOTCONN``)
while its server is away, an NFS client ``ESTALE`` for a handle whose file was replaced on another node and, soft
mounted, ``EIO`` or ``ETIMEDOUT``; each node's client also serves cached entries for a while, so a file another
node just renamed into place may look absent. None of that says anything about the bytes. So:

* :func:`retrying` retries a read that fails with a transient errno (:data:`TRANSIENT`) for up to
  :data:`READ_RETRY_S`, then raises :class:`~pipeline.errors.ReadFailed` naming the path and the error; any other
  ``OSError`` of a read (``EACCES``...) is :class:`ReadFailed` at once. ``FileNotFoundError`` passes through:
  absence is for the caller to judge, after :func:`settled_absent`.
* Only a :class:`~pipeline.errors.VerificationError` (bytes read whole that are wrong, a record that parses wrong
  after a whole read, a listed file absent past :func:`absent_settle_s`) is damage. Callers catch
  ``VerificationError`` to quarantine or fall back, and let ``ReadFailed`` end the act untaken.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeGuard, TypeVar

from pipeline.errors import ReadFailed

T = TypeVar("T")

TRANSIENT = frozenset(
    getattr(errno, name)
    for name in (
        "EIO", "ESTALE", "ETIMEDOUT", "ENOTCONN", "EINTR", "EAGAIN", "ECONNRESET", "ECONNABORTED", "ECONNREFUSED",
        "EHOSTUNREACH", "EHOSTDOWN", "ENETUNREACH", "ENETDOWN", "ENETRESET", "EREMOTEIO", "ENOLINK", "ECOMM",
    )
    if hasattr(errno, name)
)  # fmt: skip
"""Errnos of a read that say the storage did not answer, not what the bytes are."""

READ_RETRY_S = 10.0
"""How long a read failing with a :data:`TRANSIENT` errno is retried before it is :class:`ReadFailed`."""
RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0)
"""Pauses between tries (the last repeats until :data:`READ_RETRY_S` is spent)."""

ABSENT_SETTLE_S = 1.0
"""How long a file a record lists may look absent through this node's mount before it counts as missing: a
client's cached negative entry (another node's rename not seen yet) lasted under a second on the mounts measured.
``PIPELINE_ABSENT_SETTLE_S`` sets it for mounts that cache longer (NFS with ``lookupcache=all``: up to
``acdirmax``)."""


def absent_settle_s() -> float:
    """:data:`ABSENT_SETTLE_S`, or ``PIPELINE_ABSENT_SETTLE_S`` when set (a number of seconds)."""
    raw = os.environ.get("PIPELINE_ABSENT_SETTLE_S", "").strip()
    try:
        return max(0.0, float(raw)) if raw else ABSENT_SETTLE_S
    except ValueError:
        return ABSENT_SETTLE_S


def is_transient(e: BaseException) -> TypeGuard[OSError]:
    """Whether ``e`` is an ``OSError`` whose errno says the storage did not answer (:data:`TRANSIENT`)."""
    return isinstance(e, OSError) and e.errno in TRANSIENT


def unknown(e: BaseException) -> bool:
    """Whether ``e`` says only that the storage did not answer (:class:`ReadFailed`, or a transient ``OSError``
    of a write): no act may follow from it, and a later pass may succeed."""
    return isinstance(e, ReadFailed) or is_transient(e)


def failed(e: OSError, what: str, path: Path | str, tried_s: float | None = None) -> ReadFailed:
    """The one-line :class:`ReadFailed` for reading ``what`` at ``path``."""
    reason = e.strerror or type(e).__name__
    name = errno.errorcode.get(e.errno or 0, "")
    tried = f", retried for {tried_s:.0f} s" if tried_s else ""
    return ReadFailed(
        f"cannot read {what} {path}: {reason}{f' ({name})' if name else ''}{tried}: unknown, not damage "
        "(nothing is quarantined or rolled back for it); check the mount or the storage server, then rerun"
    )


def retrying(read: Callable[[], T], what: str, path: Path | str, budget_s: float | None = None) -> T:
    """``read()``, tried again while it fails with a :data:`TRANSIENT` errno for up to ``budget_s`` (default
    :data:`READ_RETRY_S`); then, or at once for any other ``OSError`` but absence, :class:`ReadFailed`.
    ``FileNotFoundError`` and ``NotADirectoryError`` pass through untouched."""
    budget = READ_RETRY_S if budget_s is None else budget_s
    start = time.monotonic()
    tries = 0
    while True:
        try:
            return read()
        except (FileNotFoundError, NotADirectoryError):
            raise
        except OSError as e:
            spent = time.monotonic() - start
            if not is_transient(e) or spent >= budget:
                raise failed(e, what, path, spent if is_transient(e) else None) from e
            time.sleep(min(RETRY_DELAYS_S[min(tries, len(RETRY_DELAYS_S) - 1)], max(0.0, budget - spent)))
            tries += 1


def lstat(path: Path | str, what: str = "file") -> os.stat_result:
    """``os.lstat`` through :func:`retrying`."""
    return retrying(lambda: os.lstat(path), what, path)


def settled_absent(path: Path | str, what: str = "file", settle_s: float | None = None) -> bool:
    """Whether ``path`` is still absent after :func:`absent_settle_s` of looking again (False as soon as it
    shows): the positive evidence a missing listed file needs."""
    deadline = time.monotonic() + (absent_settle_s() if settle_s is None else settle_s)
    delay = 0.05
    while True:
        try:
            lstat(path, what)
            return False
        except (FileNotFoundError, NotADirectoryError):
            pass
        if time.monotonic() >= deadline:
            return True
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
