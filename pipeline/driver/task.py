"""What runs inside one task of a stage job: re-check inputs, run the stage, record how it ended.

Task 0 owns the stage record (``stages/<stage>.json``); other tasks only run the stage. A task that fails
writes one :func:`failure_line` to its stderr before the traceback, so the launcher can tell which task of a
job failed first, and with what, without parsing tracebacks (see :func:`parse_failure_line`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from pathlib import Path

from pipeline.config.schema import PipelineConfig
from pipeline.errors import one_line
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import JobRef, TaskContext
from pipeline.stagekit.records import now_iso, slurm_restart, write_record
from pipeline.stages import get_stage
from pipeline.storage.layout import restrict_umask

INPROCESS = "inprocess"
"""``job_id`` of a stage run in the launching process (its stderr is the user's terminal, not a log)."""

_FAILURE = re.compile(r"TASK FAILED rank (\d+) at (\d+(?:\.\d+)?): (.*)")


def failure_line(rank: int, error: BaseException, at: float) -> str:
    """``TASK FAILED rank K at <unix time>: <ExcType>: <message on one line>``."""
    message = one_line(str(error))
    return f"TASK FAILED rank {rank} at {at:.3f}: {type(error).__name__}{': ' if message else ''}{message[:1000]}"


def parse_failure_line(line: str) -> tuple[int, float, str] | None:
    """(rank, unix time, ``<ExcType>: <message>``) of a :func:`failure_line`, wherever it sits in ``line``."""
    m = _FAILURE.search(line)
    return (int(m.group(1)), float(m.group(2)), m.group(3).strip()) if m else None


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def execute_task(
    stage: str,
    cfg: PipelineConfig,
    run_dir: str,
    attempt: str,
    rank: int = 0,
    world_size: int = 1,
    job_id: str = INPROCESS,
    beside: JobRef | None = None,
) -> dict[str, object]:

    restrict_umask()
    setup_logging(rank)
    layout = RunLayout(Path(run_dir))
    module = get_stage(stage)
    ctx = TaskContext(cfg=cfg, layout=layout, attempt=attempt, rank=rank, world_size=world_size, beside=beside)
    started = now_iso()
    t0 = time.monotonic()
    common = {"attempt": attempt, "job_id": job_id, "started": started, "world_size": world_size, "pid": os.getpid()}
    common["restart"] = slurm_restart()  # which run of the job: a ghost of an earlier run shares its job id

    def record(status: str, **extra: object) -> None:
        if rank == 0 and layout.stages.is_dir():
            ended = {} if status == "running" else {"ended": now_iso(), "seconds": round(time.monotonic() - t0, 3)}
            write_record(layout, stage, status=status, **ended, **extra, **common)

    record("running")
    try:
        if not module.CONTRACT.creates_run:
            module.check_inputs(cfg, layout)  # a scheduler's dependency is not proof that the inputs exist
        summary = module.run(ctx)
    except BaseException as e:
        if job_id != INPROCESS:  # first, before anything that may block or fail: what the launcher reports
            with contextlib.suppress(OSError):  # a full disk: the launcher says so instead
                print(failure_line(rank, e, time.time()), file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):  # the record on a full disk must not replace the task's own error
            record("failed", error=f"{type(e).__name__}: {e}")
        raise
    # A train that saved on SLURM's USR2 is requeued: the same attempt runs again, so it has not ended.
    record("requeued" if summary.get("requeue") else "succeeded", summary=summary)
    return summary
