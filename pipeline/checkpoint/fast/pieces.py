"""A blob cut into pieces, each hashed once: what lets a node keep one copy of a tensor that several of its ranks
hold, and a peer receive only the bytes it does not already have.

Each tensor of at least :data:`OBJECT_MIN` bytes is a piece of its own, kept in a node dir's ``objects/`` under
its hash (content-addressed: two ranks, or two steps, with the same bytes share one file); the bytes between
those tensors (the header, small tensors) are *inline* pieces, kept in the copy's own file. Which tensors are
replicated is never assumed from names or the parallel layout: it is recognised by equal hashes of the bytes each
rank actually packed (a DDP model and its optimizer moments, the replicated dimension of HSDP, frozen weights step
after step). A copy's *digest* (its entry in the step's table) is the hash of its piece list, so checking every
piece's bytes against the list checks every byte of the blob (a one-piece copy's digest is that piece's hash: the
whole blob's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import xxhash

OBJECT_MIN = 4096
"""Tensors at least this big (bytes) are pieces of their own (content-addressed objects)."""

Part = tuple[int, str, bool]
"""A piece: its length, the xxh3-128 of its bytes, and whether it is an object (else inline)."""


def digest(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def cut(size: int, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """``[0, size)`` as consecutive (start, end, is_object) ranges: each span of at least :data:`OBJECT_MIN`
    bytes an object, what lies between them inline."""
    out: list[tuple[int, int, bool]] = []
    at = 0
    for b, e in spans:
        if e - b < OBJECT_MIN:
            continue
        if b > at:
            out.append((at, b, False))
        out.append((b, e, True))
        at = e
    if size > at:
        out.append((at, size, False))
    return out


def hashed(blob: memoryview | Callable[[int, int], memoryview], ranges: Sequence[tuple[int, int, bool]]
           ) -> tuple[Part, ...]:  # fmt: skip
    """Each range's (length, hash, is_object): one pass over the blob's bytes (a buffer, or a function giving the
    bytes from ``b`` to ``e``: :meth:`.codec.Blob.bytes`)."""
    read = blob if callable(blob) else lambda b, e: blob[b:e]
    return tuple((e - b, digest(read(b, e)), obj) for b, e, obj in ranges)


def digest_of(parts: Sequence[Part]) -> str:
    """A copy's digest: its one piece's hash, else the hash of its piece list."""
    if len(parts) == 1 and not parts[0][2]:
        return parts[0][1]
    return digest(";".join(f"{n}:{h}:{int(o)}" for n, h, o in parts).encode())


def offsets(parts: Sequence[Part]) -> list[int]:
    """Where each piece starts in the blob."""
    out, at = [], 0
    for n, _, _ in parts:
        out.append(at)
        at += n
    return out


def inline_size(parts: Sequence[Part]) -> int:
    """The bytes a copy's own file holds (its inline pieces, one after another)."""
    return sum(n for n, _, o in parts if not o)


def objects(parts: Sequence[Part]) -> set[str]:
    return {h for _, h, o in parts if o}
