"""What runs inside one task of a stage job: re-check inputs, run the stage, record how it ended.

Task 0 owns the stage record (``stages/<stage>.json``); other tasks only run the stage.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from pipeline.config.schema import PipelineConfig
from pipeline.orchestration.contract import TaskContext
from pipeline.orchestration.records import now_iso, write_record
from pipeline.stages import get_stage
from pipeline.storage.layout import RunLayout, restrict_umask


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
    job_id: str = "inprocess",
) -> dict[str, object]:

    restrict_umask()
    setup_logging(rank)
    layout = RunLayout(Path(run_dir))
    module = get_stage(stage)
    ctx = TaskContext(cfg=cfg, layout=layout, attempt=attempt, rank=rank, world_size=world_size)
    started = now_iso()
    t0 = time.monotonic()
    common = {"attempt": attempt, "job_id": job_id, "started": started, "world_size": world_size, "pid": os.getpid()}

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
        record("failed", error=f"{type(e).__name__}: {e}")
        raise
    record("succeeded", summary=summary)
    return summary
