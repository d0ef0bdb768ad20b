"""Which test sessions (pytest-xdist workers) use a cluster the tests start: the first starts it, the last stops it."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.stagekit.records import pid_alive


@contextmanager
def session_users(root: Path) -> Iterator[dict[str, Any]]:
    """The sessions using the cluster whose state lives in ``root`` (``{"pids": [...], "started": bool}``), under
    an exclusive lock held while the caller starts or stops it; a crashed session is no user."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "test-sessions.json"
    with open(root / "test-sessions.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(path.read_text()) if path.exists() else {"pids": [], "started": False}
        state["pids"] = [p for p in state.get("pids", []) if pid_alive(p)]
        yield state
        path.write_text(json.dumps(state))
