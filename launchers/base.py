"""The ``Launcher`` interface: how the runner hands a stage job to whatever runs it."""

from __future__ import annotations

from pipeline.orchestration.runner import StageJob


class Launcher:
    """Interface: run one stage job to completion (with a deadline) or raise :class:`StageFailedError`."""

    def run_stage(self, job: StageJob) -> None:
        raise NotImplementedError
