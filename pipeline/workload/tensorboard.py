"""Train's metrics also as TensorBoard event files (``<run>/tensorboard/``) when ``tensorboard`` is installed.

Rank 0 only, beside ``metrics.jsonl`` (which stays the record): ``loss``, ``lr``, ``tokens_per_s``, ``eval_loss``
and each checkpoint's bytes and blocked seconds, against the step. Advisory like the JSONL: a failure to write
is logged once and training goes on.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SCALARS = {
    "step": {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s"},
    "eval": {"loss": "eval/loss"},
    "checkpoint": {"bytes": "checkpoint/bytes", "blocked_s": "checkpoint/blocked_s", "seconds": "checkpoint/seconds"},
}


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        self._writer: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional dependency
        except ImportError:
            return
        try:
            self._writer = SummaryWriter(log_dir=str(log_dir))
        except OSError as e:
            log.warning("no TensorBoard events: %s", e)

    def add(self, event: dict[str, Any]) -> None:
        if self._writer is None or "step" not in event:
            return
        for key, tag in _SCALARS.get(str(event.get("event")), {}).items():
            value = event.get(key)
            if isinstance(value, int | float):
                try:
                    self._writer.add_scalar(tag, value, int(event["step"]))
                except OSError as e:
                    log.warning("TensorBoard events stopped: %s", e)
                    self._writer = None
                    return

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
