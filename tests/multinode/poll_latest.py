"""Poll a run's ``latest`` from one node while other nodes write, and verify every step it names.

    python -m tests.multinode.poll_latest RUN_DIR OUT.json STOP_FILE

Runs until ``STOP_FILE`` exists (or 30 minutes). Each poll reads ``latest`` (checked against its manifest's hash)
and, for every step it names for the first time, re-reads the step's files against its manifest. The verdict is
written to ``OUT.json``: the steps seen, each move of the ``latest`` pointer (step, epoch), and each violation (a
``latest`` that did not read, a named step that did not verify, the step a reader resumes from going back) with
its time. A reader that finds ``latest`` mid-replace sees old or new, never a mix, on this
filesystem; any error is a violation.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.errors import PipelineError
from pipeline.storage.layout import CheckpointLayout

POLL_S = 0.2
MAX_S = 1800.0


def main(run_dir: str, out: str, stop: str) -> None:
    store = PosixCheckpoints(CheckpointLayout(Path(run_dir)))
    seen: list[int] = []
    violations: list[str] = []
    moves: list[list[int | None]] = []  # each change of (latest's step, its epoch), in order
    newest = -1
    polls = 0
    t0 = time.monotonic()
    while not Path(stop).exists() and time.monotonic() - t0 < MAX_S:
        polls += 1
        try:
            latest = store.read_latest()
        except (PipelineError, OSError) as e:
            violations.append(f"{time.time():.3f} latest unreadable: {e}")
            latest = None
        if latest is not None and (not moves or moves[-1][0] != latest.step):
            moves.append([latest.step, store.latest_epoch()])  # the pointer (a ghost's late move shows here)
        try:
            resumes = store.newest()  # what a reader resumes from: it must never go back
        except (PipelineError, OSError) as e:
            violations.append(f"{time.time():.3f} a reader cannot resume: {e}")
            resumes = None
        if resumes is not None and resumes.step < newest:
            violations.append(f"{time.time():.3f} a reader's latest went back from step {newest} to {resumes.step}")
        newest = max(newest, resumes.step if resumes is not None else -1)
        if latest is not None and latest.step not in seen:
            try:
                store.verify_committed(latest.step)
                seen.append(latest.step)
            except (PipelineError, OSError) as e:
                if _still_named(store, latest.step):  # not a step retention removed after latest moved on
                    violations.append(f"{time.time():.3f} latest names step {latest.step}, which does not verify: {e}")
        time.sleep(POLL_S)
    Path(out).write_text(json.dumps({"seen": seen, "violations": violations, "polls": polls, "moves": moves}))


def _still_named(store: PosixCheckpoints, step: int) -> bool:
    try:
        latest = store.read_latest()
    except (PipelineError, OSError):
        return True
    return latest is not None and latest.step == step


if __name__ == "__main__":
    main(*sys.argv[1:4])
