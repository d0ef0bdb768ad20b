"""``<run>/metrics.jsonl``: one JSON object per line, appended by train's rank 0, tailed by the launching process.

Owner: rank 0 of the train job, the only writer (a run's launches never overlap), across every attempt, so
the file is the run's whole training history; each event carries its ``attempt``. Nothing ever rewrites or
truncates it.

Each event is one ``os.write`` of a complete line to a descriptor opened with ``O_APPEND``, opened and closed
per line: a reader sees whole lines or a partial last one (which :class:`MetricsTail` leaves until its newline
arrives), and on NFS the close pushes the line to the server, where a tail on another node can read it. There
is no fsync per line: the file is a progress report, not a checkpoint; a crash loses at most its last lines,
while an fsync per step on a shared filesystem would cost every step a round trip to stable storage.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_NEWLINE = b"\n"


class MetricsWriter:
    """Append events to a JSONL file. Failures to write are logged once, never raised: metrics are advisory,
    and a full disk must not stop training between checkpoints (the checkpoints report it themselves)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._warned = False
        try:
            self._end_partial_line()
        except OSError as e:
            self._warn(e)

    def append(self, event: dict[str, Any]) -> None:
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, line)  # one write per line: appended whole at the end of the file
            finally:
                os.close(fd)
        except OSError as e:
            self._warn(e)

    def _end_partial_line(self) -> None:
        """An earlier attempt killed mid-write may have left a line without its newline: end it, so that our
        first event is not glued to it (the reader skips the broken line)."""
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != _NEWLINE:
                os.write(fd, _NEWLINE)
        finally:
            os.close(fd)

    def _warn(self, e: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning("cannot append to %s (%s): per-step metrics are not recorded; training continues", self.path, e)


class MetricsTail:
    """Read the lines appended to a JSONL file since the last :meth:`read`, as dicts.

    A trailing line without its newline is left for a later read. Lines that are not JSON objects are skipped
    (a crashed writer's broken line must not stop the reader). A file that shrank was replaced (the run was
    deleted and started over): reading starts again from its beginning.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.skipped = 0
        """Complete lines that were not JSON objects."""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(_NEWLINE) + 1  # 0 when no line is complete yet
        self.offset += end
        events: list[dict[str, Any]] = []
        for raw in data[:end].splitlines():
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:  # includes UnicodeDecodeError
                obj = None
            if isinstance(obj, dict):
                events.append(obj)
            else:
                self.skipped += 1
        return events
