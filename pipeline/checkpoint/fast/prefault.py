"""Fault in the memory a restore is about to receive into, ahead of the bytes, in one background thread.

A replaced node's process receives most of its state into memory it has never touched: the optimizer's moments
(:func:`~.landing.prime` makes them uninitialised) and the buffer for what lands nowhere else. Left to the
receive, each of those pages costs the receiving thread a trap and a zeroed page as the bytes arrive, and on a
virtual machine the trap is the dearer part. ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) faults a whole range in
one call, in the kernel, without writing a byte of it, so a thread that runs it over the destinations, in the
order the bytes arrive, keeps ahead of the link and the receive finds its pages in place.

It only ever maps pages in: what a range holds is never changed (a page already there, or already written by the
receive, is left as it is), so it is safe in any order against the receive. Where the call is not there (another
OS, an older kernel) or fails, the range is left to fault in as before: it is a speed-up, never a condition.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading
from collections.abc import Sequence
from functools import cache

import torch

from pipeline.checkpoint.fast.codec import over

__all__ = ["Prefault", "populate"]

_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23
_PAGE = mmap.PAGESIZE
_CHUNK = 32 << 20
"""One call's range: the thread stops between calls when asked, and keeps to the order the bytes arrive in."""
WAIT_S = 60.0
"""The longest :meth:`Prefault.wait` waits (a call maps at most ``_CHUNK`` bytes in: well under a second)."""


@cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _pages(t: torch.Tensor | memoryview) -> tuple[int, int] | None:
    """The whole pages inside ``t``'s bytes (start, length); None: none (an edge page may hold other data, so
    only pages the tensor alone covers are touched)."""
    if isinstance(t, memoryview):
        if not t.nbytes:
            return None
        t = over(t)  # only its address is wanted
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    return (first, last - first) if last > first else None


def populate(region: torch.Tensor | memoryview, *, write: bool = True) -> int:
    """Fault ``region``'s whole pages in now, in this thread (a snapshot file's mapping, before the copy into it);
    the bytes mapped in (0 where the call is missing or refused)."""
    r, fn = _pages(region), _madvise()
    if r is None or fn is None:
        return 0
    start, length = r
    return length if fn(start, length, _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ) == 0 else 0


class Prefault:
    """Start faulting in the memory of ``regions`` (tensors to be written, or with ``write=False`` mappings of
    files to be read: a holder's copy), in their order, in a thread; :meth:`stop` once the bytes are in (what is
    left is of no use then), :meth:`wait` for all of it. ``faulted``: the bytes the kernel mapped in (0 where the
    call is missing or refused)."""

    def __init__(self, regions: Sequence[torch.Tensor | memoryview], *, write: bool = True) -> None:
        self._ranges = [r for r in map(_pages, regions) if r is not None]
        self._how = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
        self.regions: list[torch.Tensor | memoryview] = list(regions)
        """Kept alive until done (the ranges are theirs)."""
        self._stop = threading.Event()
        self.faulted = 0
        self._thread: threading.Thread | None = None
        if self._ranges and _madvise() is not None:
            self._thread = threading.Thread(target=self._run, name="fast-restore-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        fn = _madvise()
        for start, length in self._ranges:
            for at in range(start, start + length, _CHUNK):
                n = min(_CHUNK, start + length - at)
                if self._stop.is_set() or fn is None or fn(at, n, self._how) != 0:
                    return  # not supported here, or memory is short: the receive faults the rest in itself
                self.faulted += n

    def stop(self) -> None:
        self._stop.set()
        self.wait()

    def wait(self, timeout_s: float = WAIT_S) -> None:
        """Until the thread is done, at most ``timeout_s``: one still in a call after that is left to end on its
        own (it holds only addresses, and mapping pages in is harmless wherever they now belong)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.regions = []
