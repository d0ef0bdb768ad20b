"""Command-line overrides: which run a launch is about, and what a continuation replays.

``run.id=<id>`` (or ``run.id=last``) continues a run: its recorded overrides (``run.yaml``) are replayed under
the new ones, so ``python -m pipeline run.id=<id>`` needs nothing else. An unknown id is an error unless
``run.create=true`` (so a typo never starts a new run). ``hydra.*`` overrides that would move the run dir or
change how jobs are launched are refused: the pipeline owns both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException

from pipeline.config.identity import RunRecord, is_per_launch, read_run_record
from pipeline.errors import ConfigError, RunNotFoundError
from pipeline.rundir.layout import RUN_YAML
from pipeline.rundir.runs import DEFAULT_ROOT, locate_run, newest_runs

# hydra.* settings a user may change: logging, and the config search path (your own conf/, also given as
# --config-dir). Everything else (run/sweep dirs, output_subdir, chdir, launcher, sweeper) is the pipeline's:
# the run dir is <run.root>/<experiment>/<run.id>.
SEARCHPATH = "hydra.searchpath"
_HYDRA_ALLOWED = (
    SEARCHPATH,
    "hydra.verbose",
    "hydra.job_logging",
    "hydra.hydra_logging",
    "hydra/job_logging",
    "hydra/hydra_logging",
)


def parse(overrides: list[str]) -> list[Override]:
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot parse the overrides {' '.join(overrides)!r}: {first}") from e


def key_of(o: Override) -> str:
    key = o.key_or_group
    return f"{key}@{o.package}" if o.package else key


def value_of(parsed: list[Override], key: str) -> Any:
    """The (non-sweep) value given for ``key`` on the command line, or None."""
    for o in parsed:
        if o.key_or_group == key and not o.is_delete():
            return o.value()
    return None


def check_hydra_overrides(parsed: list[Override]) -> None:
    for o in parsed:
        key = o.key_or_group
        if (key == "hydra" or key.startswith(("hydra.", "hydra/"))) and not key.startswith(_HYDRA_ALLOWED):
            raise ConfigError(
                f"{o.input_line}: {key} is set by the pipeline (run dirs are <run.root>/<experiment>/<run.id>; "
                "stages are submitit jobs chosen with launcher=...); hydra.verbose and hydra logging may be set"
            )


def carried(overrides: list[str]) -> list[str]:
    """The overrides a run records for later launches: per-launch keys and hydra.* are left out, except the
    config search path (a continuation composes the same experiment from the same conf/ dirs)."""
    return [
        str(o.input_line)
        for o in parse(overrides)
        if not is_per_launch(o.key_or_group)
        and (o.key_or_group == SEARCHPATH or not o.key_or_group.startswith(("hydra.", "hydra/")))
    ]


def merge(recorded: list[str], new: list[str]) -> list[str]:
    """Replay ``recorded`` under ``new``: a key given now replaces the recorded one."""
    given = {key_of(o) for o in parse(new)}
    return [str(o.input_line) for o in parse(recorded) if key_of(o) not in given] + new


@dataclass(frozen=True)
class RunRef:
    """Which run a launch is about."""

    run_dir: Path | None
    """The existing run's directory; None for a new run."""
    record: RunRecord | None
    """Its ``run.yaml``; None for a new run."""


def find_run(parsed: list[Override]) -> RunRef:
    """Resolve ``run.id`` (``last`` included) to an existing run, or decide that this launch creates one."""
    run_id = value_of(parsed, "run.id")
    if run_id is None:
        return RunRef(None, None)
    root = Path(str(value_of(parsed, "run.root") or DEFAULT_ROOT)).resolve()
    experiment = value_of(parsed, "experiment")
    experiment = str(experiment) if experiment is not None else None
    found = locate_run(str(run_id), root, experiment)
    matches = [found] if found is not None else []
    if matches:
        return RunRef(matches[0], read_run_record(matches[0] / RUN_YAML))
    if value_of(parsed, "run.create") is True:
        if experiment is None:
            raise ConfigError(f"run.create=true makes run {run_id!r} a new run: add +experiment=<name>")
        return RunRef(None, None)
    names = ", ".join(d.name for d in newest_runs(root, experiment)) or "none"
    raise RunNotFoundError(
        f"unknown run id {run_id!r} under {root} (newest: {names}); continue one of those with run.id=<id>, "
        "or add run.create=true to start a new run with this id"
    )
