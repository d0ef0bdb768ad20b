"""DCP's file names in a step dir, defined once (no imports: the committer's listing code reads them cheaply)."""

from __future__ import annotations

METADATA_FILE = ".metadata"
"""DCP's step metadata, written by the coordinator (rank 0)."""
