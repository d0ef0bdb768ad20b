"""Where the config tree lives: ``conf/`` beside the package, or ``PIPELINE_CONF_DIR``."""

from __future__ import annotations

import os
from pathlib import Path


def conf_dir() -> Path:
    return Path(os.environ.get("PIPELINE_CONF_DIR", Path(__file__).resolve().parents[2] / "conf"))
