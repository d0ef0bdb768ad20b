"""DCP's file names in a step dir, defined once (no imports beyond ``re``: the committer's listing code reads them
cheaply)."""

from __future__ import annotations

import re

METADATA_FILE = ".metadata"
"""DCP's step metadata, written by the coordinator (rank 0)."""

SHARED_GROUPS = ("frozen", "buffers")
"""Groups of items saved apart from the rest, as shared pieces: parameters that do not train, and buffers."""

DATA_FILE = re.compile(r"^__(\d+)_(?:\d+|(?:frozen|buffers)\d+)\.distcp$")
"""A rank's DCP data file: ``__K_<n>.distcp`` (DCP's own name), or a shared piece ``__K_<group><n>.distcp``."""

_PIECE = re.compile(r"^__\d+_(?:frozen|buffers)\d+\.distcp$")


def piece_name(rank: int, group: str, index: int) -> str:
    """Rank ``rank``'s ``index``-th file of ``group``: a piece a later step may share when its bytes are unchanged."""
    return f"__{rank}_{group}{index}.distcp"


def is_piece(name: str) -> bool:
    """Whether ``name`` is a shared piece's file name (its bytes may be shared with other steps)."""
    return _PIECE.match(name) is not None
