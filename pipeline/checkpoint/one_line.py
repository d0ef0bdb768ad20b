"""Errors a ``torchrun`` user can read: a :class:`~pipeline.errors.PipelineError` that ends a training script is
printed as one line per rank (``error: [rank K] ...``), not a traceback per rank.

Installed by the first :class:`~pipeline.checkpoint.Checkpointer` of a process (``sys.excepthook`` chains to the
one it found, for every other exception). ``PIPELINE_TRACEBACK=1`` prints the traceback as well.
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType

from pipeline.errors import PipelineError

TRACEBACK_ENV = "PIPELINE_TRACEBACK"
_installed: list[bool] = []


def install() -> None:
    """Chain the one-line printer in front of the current ``sys.excepthook`` (once per process)."""
    if _installed:
        return
    _installed.append(True)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(value, PipelineError):
            previous(kind, value, tb)
            return
        if os.environ.get(TRACEBACK_ENV) == "1":
            traceback.print_exception(kind, value, tb)
        rank = os.environ.get("RANK")
        where = f"[rank {rank}] " if rank is not None else ""
        line = f"error: {where}{' '.join(str(value).split())}\n"
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), line.encode())  # one write: ranks sharing a terminal never interleave a line

    sys.excepthook = hook
