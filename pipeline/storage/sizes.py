"""Sizes as people write them (``500KB``, ``2MB``, ``5GB``, ``1GiB``): config keys and command lines alike."""

from __future__ import annotations

import re

from pipeline.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+)\s*(B|KB|MB|GB|KIB|MIB|GIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"size {text!r} is not understood: write e.g. 500KB, 2MB or 5GB")
    return int(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]
