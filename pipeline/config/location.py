"""Where the config tree lives: ``conf/`` of the source tree, ``pipeline/conf`` of an installed wheel, or
``PIPELINE_CONF_DIR``. Your own configs are added with ``--config-dir`` (or ``hydra.searchpath``)."""

from __future__ import annotations

import os
from pathlib import Path

_SOURCE_TREE = Path(__file__).resolve().parents[2] / "conf"
_INSTALLED = Path(__file__).resolve().parents[1] / "conf"


def conf_dir() -> Path:
    if os.environ.get("PIPELINE_CONF_DIR"):
        return Path(os.environ["PIPELINE_CONF_DIR"])
    return _SOURCE_TREE if (_SOURCE_TREE / "config.yaml").is_file() else _INSTALLED
