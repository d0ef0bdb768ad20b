"""The restore's prefault (``pipeline.checkpoint.fast.prefault``): it maps the receive's pages in ahead of the
bytes and never changes what a range holds, whichever of it and the receive gets to a page first."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from pipeline.checkpoint.fast.prefault import _PAGE, Prefault, _madvise, _pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


def _resident(t: torch.Tensor) -> int:
    """Pages of ``t``'s whole-page range that are mapped in (mincore)."""
    import ctypes  # noqa: PLC0415

    start, length = _pages(t) or (0, 0)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    vec = (ctypes.c_ubyte * (length // _PAGE))()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec)


@linux
def test_a_fresh_tensor_is_mapped_in_without_a_byte_written_and_what_it_holds_is_kept() -> None:
    assert _madvise() is not None
    fresh = torch.empty(48 << 20, dtype=torch.uint8)  # large: its own mapping, never touched
    start, length = _pages(fresh) or (0, 0)
    assert _resident(fresh) < length // _PAGE // 2
    written = torch.empty(16 << 20, dtype=torch.uint8)
    written.copy_(torch.arange(written.numel()) % 251)
    ahead = Prefault([fresh, written])
    ahead.wait()
    assert ahead.faulted == length + (_pages(written) or (0, 0))[1]
    assert _resident(fresh) == length // _PAGE
    assert torch.equal(written, torch.arange(written.numel()) % 251)  # nothing of it changed


@linux
def test_bytes_written_while_the_prefault_runs_are_all_there_after_it() -> None:
    for _ in range(3):
        t = torch.empty(96 << 20, dtype=torch.uint8)
        ahead = Prefault([t])
        writer = threading.Thread(target=t.fill_, args=(7,))  # as the receive writes, at the same time
        writer.start()
        writer.join()
        ahead.stop()
        assert int(t.min()) == 7 == int(t.max())


def test_only_whole_pages_of_contiguous_cpu_tensors_are_ranges() -> None:
    big = torch.empty(1 << 20, dtype=torch.uint8)
    start, length = _pages(big[1:]) or (0, 0)
    assert start % _PAGE == 0 and big.data_ptr() < start and start + length <= big.data_ptr() + big.numel()
    assert _pages(torch.empty(64, dtype=torch.uint8)) is None or _PAGE <= 64
    assert _pages(torch.empty(1024, 1024)[:, ::2]) is None  # not contiguous
    Prefault([]).stop()  # nothing to do: no thread
