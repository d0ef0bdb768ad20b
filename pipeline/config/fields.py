"""Field metadata of the config schema (stopes-style: marked where the field is defined, never in a hand-kept list).

A run's identity is every field not marked; ``MUTABLE`` fields are recorded with the run and carried to later
launches but may change between them; ``PER_LAUNCH`` fields belong to one launch only (not recorded).
"""

from __future__ import annotations

from typing import Final

MUTABLE: Final = {"identity": False}
PER_LAUNCH: Final = {"identity": False, "per_launch": True}
