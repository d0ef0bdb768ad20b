"""The ``Launcher`` interface: how the runner hands a planned stage job to whatever runs it."""

from __future__ import annotations

from pipeline.orchestration.runner import JobWatch, StageJob


class Launcher:
    """Run one stage job to completion, or raise.

    ``run_stage`` reports the job id through ``watch.started`` and calls ``watch.poll`` while it waits. When it
    raises for any reason (failure, deadline, ``Interrupted``), the job has been cancelled and its processes
    are gone (bounded by ``launcher.cancel_timeout_s``): nothing outlives the launch.
    """

    def run_stage(self, job: StageJob, watch: JobWatch) -> None:
        raise NotImplementedError
