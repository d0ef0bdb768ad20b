"""Paths of the app's run directory: ``outputs/<experiment>/<run_id>/`` (see docs/design.md, "Run layout").

The checkpoint protocol's names are the library's (:class:`~pipeline.storage.layout.CheckpointLayout`); a run
dir adds the app's entries around them: ``run.yaml``, the lease, stage records, logs, assets. The library never
imports this module. Pure functions of the run dir: no rank, clock or host ever enters a path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.storage.layout import CheckpointLayout

RUN_YAML = "run.yaml"
"""The run's record (``pipeline/config/identity.py``): what a run dir is recognised by."""


@dataclass(frozen=True)
class RunLayout(CheckpointLayout):
    """``outputs/<experiment>/<run_id>/`` and everything under it (see docs/design.md, "Run layout")."""

    @staticmethod
    def for_run(root: str | Path, experiment: str, run_id: str) -> RunLayout:
        return RunLayout(Path(root).resolve() / experiment / run_id)

    @property
    def run_yaml(self) -> Path:
        return self.run_dir / RUN_YAML

    @property
    def lease(self) -> Path:
        """Who owns the run now: one launching process at a time (``pipeline/driver/lease.py``)."""
        return self.run_dir / "lease.json"

    @property
    def lease_lock(self) -> Path:
        """flock'ed while a launch takes, updates or releases the lease; never deleted."""
        return self.run_dir / ".lease.lock"

    @property
    def broken_leases(self) -> Path:
        """Stale leases moved aside when a launch breaks them (kept, never deleted)."""
        return self.logs / "leases"

    @property
    def hydra_dir(self) -> Path:
        """Hydra's record of the newest launch (config.yaml, hydra.yaml, overrides.yaml)."""
        return self.run_dir / ".hydra"

    def launch_owned(self) -> frozenset[str]:
        """Entries of the run dir that belong to the launching process; ``run.overwrite`` keeps them (``run.yaml``
        too: whichever launch recreates a run leaves it known by its id)."""
        return frozenset(
            {self.lease.name, self.lease_lock.name, self.logs.name, self.hydra_dir.name, self.run_yaml.name}
        )

    @property
    def stages(self) -> Path:
        return self.run_dir / "stages"

    def stage_record(self, stage: str) -> Path:
        return self.stages / f"{stage}.json"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def assets(self) -> Path:
        """Tokenizer and tokenized data, written once by prepare-dirs."""
        return self.run_dir / "assets"

    def planned_dirs(self) -> list[Path]:
        """Directories prepare-dirs creates before any other job starts.

        Not here: ``assets/`` (published by prepare-dirs) and ``logs/`` (created, mode 0700, by the launching
        process, which needs it before the first job).
        """
        return [
            self.stages,
            self.checkpoints,
            self.staging,
            self.quarantine,
            self.consolidated,
            self.export,
        ]
