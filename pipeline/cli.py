"""Command line: a Hydra app. ``python -m pipeline +experiment=<name> [key=value ...]`` (see ``--help``).

Hydra composes and parses (``--help``, ``--cfg``, ``--info``, ``-m`` sweeps, shell completion, ``.hydra/``);
submitit launches the stages. Before Hydra creates anything, every launch is checked here: the overrides are
resolved against the run they continue (``run.id=<id>`` replays its recorded overrides), composed, typed,
checked against the run's identity and planned. Bad input is one line on stderr and exit 2, nothing created.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from launchers.resources import sbatch_lines
from pipeline.config.compose import conf_dir, load_config, to_typed, to_yaml
from pipeline.config.docs import hydra_template, render_help
from pipeline.config.identity import kept_global_batch
from pipeline.config.overrides import SEARCHPATH, check_hydra_overrides, find_run, merge, parse, value_of
from pipeline.config.schema import STAGE_ALL, PipelineConfig, register_configs, schema_key
from pipeline.driver.plan import Plan, make_plan
from pipeline.driver.progress import format_bytes
from pipeline.driver.runner import Interrupted, check_identity, new_run_id, status_lines
from pipeline.errors import ConfigError, PipelineError
from pipeline.rundir.layout import RunLayout
from pipeline.stages import ORDER, get_stage
from pipeline.storage.layout import restrict_umask

_INFO_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")
_exit_codes: list[int] = []
_launch: list[Prepared] = []
"""The one launch the checks prepared (not a sweep): Hydra's task uses its typed config and plan."""


@dataclass(frozen=True)
class Prepared:
    """One launch, checked: the overrides Hydra will compose, the typed config and the plan."""

    overrides: list[str]
    cfg: PipelineConfig
    plan: Plan
    notes: tuple[str, ...] = ()
    """Lines to show before the launch runs (what the launch decided for the user)."""


def prepare(overrides: list[str], *, fix_new_id: bool = True) -> Prepared:
    parsed = parse(overrides)
    check_hydra_overrides(parsed)
    ref = find_run(parsed)
    effective = list(overrides)
    if ref.record is not None and ref.run_dir is not None:
        effective = [o for o in merge(ref.record.overrides, overrides) if not o.startswith("run.id=")]
        effective.append(f"run.id={ref.run_dir.name}")
    elif value_of(parsed, "run.id") is None and fix_new_id:
        if value_of(parsed, "stage") not in (None, STAGE_ALL):
            raise ConfigError(f"stage={value_of(parsed, 'stage')} reruns one stage of an existing run: add run.id=<id>")
        effective.append(f"run.id={new_run_id()}")
    cfg = load_config(effective)
    notes: list[str] = []
    if ref.record is not None and ref.run_dir is not None and not cfg.run.overwrite:
        kept = kept_global_batch(cfg, ref.record.config)
        if kept is not None:  # recorded with the run from now on: every later launch keeps it too
            effective.append(f"train.global_batch_size={kept}")
            cfg = load_config(effective)
            notes.append(
                f"run {ref.run_dir.name} keeps its global batch of {kept} samples per step: "
                f"{kept // cfg.strategy.world_size} per rank on strategy.world_size={cfg.strategy.world_size} "
                f"(train.global_batch_size={kept})"
            )
    layout = RunLayout.for_run(cfg.run.root, cfg.experiment, cfg.run.id or new_run_id())
    _check_writable(layout.run_dir)
    check_identity(cfg, layout)
    return Prepared(effective, cfg, make_plan(cfg, layout), tuple(notes))


def _check_writable(run_dir: Path) -> None:
    """The run dir can be made: its nearest existing ancestor is a writable directory (Hydra makes it next)."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a directory" if not existing.is_dir() else "is not writable"
        raise ConfigError(f"cannot create the run dir {run_dir}: {existing} {what}; choose another run.root")


def _stage_lines() -> list[tuple[str, str]]:
    lines = []
    for name in ORDER:
        c = get_stage(name).CONTRACT
        lines.append((name, f"{c.produces} ({'one task per rank' if c.distributed else 'one task'})"))
    return lines


def _help(*, _root_: Any) -> str:
    return hydra_template(render_help(_stage_lines(), _root_))


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("pipeline_help"):
        OmegaConf.register_new_resolver("pipeline_help", _help)
        # A sweep point is a new run: its dir is made here, once, in the launching process (use_cache: stable).
        OmegaConf.register_new_resolver(
            "pipeline_new_run_dir", lambda root, exp: str(Path(root).resolve() / exp / new_run_id()), use_cache=True
        )


def _hydra_task(dcfg: DictConfig) -> None:
    """Hydra's task function: one launch (one sweep point under ``-m``). Records its exit code."""
    from launchers.factory import make_launcher  # noqa: PLC0415 - submitit only when launching
    from pipeline.driver import runner  # noqa: PLC0415

    hc = HydraConfig.get()
    try:
        run_dir = Path(hc.runtime.output_dir).resolve()
        prepared = next((p for p in _launch if p.plan.layout.run_dir == run_dir), None)
        cfg = prepared.cfg if prepared is not None else to_typed(dcfg)  # composed and typed once per launch
        if cfg.run.id is None:  # a sweep point: its dir was made by the pipeline_new_run_dir resolver
            cfg.run.id = run_dir.name
        if RunLayout.for_run(cfg.run.root, cfg.experiment, cfg.run.id).run_dir != run_dir:
            raise ConfigError(f"hydra's run dir {run_dir} is not <run.root>/<experiment>/<run.id>")
        overrides = [str(o) for o in hc.overrides.task]
        overrides += [str(o) for o in hc.overrides.hydra if str(o).startswith(f"{SEARCHPATH}=")]  # your conf/
        files = {
            "config.yaml": OmegaConf.to_yaml(dcfg),
            "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": OmegaConf.to_container(hc)})),
            "overrides.yaml": OmegaConf.to_yaml(OmegaConf.create(overrides)),
        }
        planned = prepared.plan if prepared is not None else None
        runner.run(cfg, make_launcher(cfg.launcher), overrides=overrides, hydra_files=files, planned=planned)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        _exit_codes.append(e.exit_code)
        return
    except OSError as e:  # a run root that is a file, read-only or full: one line, not a traceback
        print(f"error: {e.strerror or e} ({e.filename or 'run dir'}); check run.root and its disk", file=sys.stderr)
        _exit_codes.append(1)
        return
    _exit_codes.append(0)


def _call_hydra(argv: list[str]) -> int:
    import hydra  # noqa: PLC0415

    register_configs()
    _register_resolvers()
    _exit_codes.clear()
    main_fn = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_hydra_task)
    saved = sys.argv
    sys.argv = [saved[0], *argv]
    try:
        main_fn()
    finally:
        sys.argv = saved
    return max(_exit_codes, default=0)


def _sweep_points(overrides: list[str]) -> list[list[str]]:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # noqa: PLC0415

    try:
        return BasicSweeper.split_arguments(parse(overrides), None)[0]
    except HydraException as e:
        raise ConfigError(f"cannot expand the sweep {' '.join(overrides)!r}: {e}") from e


def _print_plan(p: Prepared) -> None:
    print(to_yaml(p.cfg))
    print(f"plan for run {p.plan.layout.run_id} ({p.plan.layout.run_dir}):")
    for planned in p.plan.stages:
        print(f"  {planned.describe()}")
        if not planned.runs:
            continue
        c = planned.contract
        print(f"       reads:  {c.reads}")
        print(f"       writes: {c.produces} (about {format_bytes(c.bytes_written(p.cfg))})")
        fast = p.cfg.checkpoint.fast
        if planned.name == "train" and fast.every is not None:
            print(f"       fast:   every {fast.every} steps, each rank's state in {fast.dir} (node-local) and on "
                  f"{fast.replicas} other node(s); newest {fast.keep} kept")  # fmt: skip
        if p.cfg.launcher.kind == "slurm":
            for line in sbatch_lines(planned, p.plan):
                print(f"       {line}")


def entry() -> None:
    """The ``pipeline`` console script (same as ``python -m pipeline``; shell completion needs this form)."""
    sys.exit(main(sys.argv[1:]))


def main(argv: list[str]) -> int:
    from hydra._internal.utils import get_args_parser  # noqa: PLC0415

    restrict_umask()
    _register_resolvers()
    if "COMP_LINE" in os.environ:  # Hydra's completion knows `python app.py` and `app`, not `python -m app`
        os.environ["COMP_LINE"] = re.sub(r"^\s*\S*python[\d.]*\s+-m\s+pipeline\b", "pipeline", os.environ["COMP_LINE"])
    argv = [schema_key(a) for a in argv]  # import.* -> the schema's import_.*
    args = get_args_parser().parse_intermixed_args(argv)  # overrides before and after -m, as Hydra allows
    flags = [a for a in argv if a not in args.overrides]
    try:
        if args.config_dir:  # recorded with the run as hydra.searchpath: continuations find the same experiments
            flags, args.overrides = _config_dir_as_searchpath(flags, args.overrides, args.config_dir)
        if any(getattr(args, f) for f in _INFO_FLAGS):
            return _call_hydra([*flags, *_expand_for_info(args.overrides)])
        if args.multirun:
            return _multirun(flags, args.overrides)
        prepared = prepare(args.overrides, fix_new_id=not _wants_status(args.overrides))
        if prepared.cfg.status:
            print("\n".join(status_lines(prepared.plan)))
            return 0
        for note in prepared.notes:
            print(note)
        if prepared.cfg.dry_run:
            _print_plan(prepared)
            return 0
        _launch[:] = [prepared]
        return _call_hydra([*flags, *prepared.overrides])
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        return e.exit_code


def _config_dir_as_searchpath(flags: list[str], overrides: list[str], config_dir: str) -> tuple[list[str], list[str]]:
    """``--config-dir D`` -> ``hydra.searchpath=[file://D]`` (your conf/ is searched after the pipeline's)."""
    path = Path(config_dir).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"--config-dir {config_dir}: no such directory")
    if value_of(parse(overrides), SEARCHPATH) is not None:
        raise ConfigError("give your conf/ once: either --config-dir or hydra.searchpath=[...]")
    out, skip = [], False
    for a in flags:
        if skip:
            skip = False
        elif a in ("--config-dir", "-cd"):
            skip = True
        elif not a.startswith(("--config-dir=", "-cd=")):
            out.append(a)
    return out, [*overrides, f"{SEARCHPATH}=[file://{path}]"]


def _wants_status(overrides: list[str]) -> bool:
    if value_of(parse(overrides), "status") is not True:
        return False
    if value_of(parse(overrides), "run.id") is None:
        raise ConfigError("status=true shows an existing run: add run.id=<id> (or run.id=last)")
    return True


def _expand_for_info(overrides: list[str]) -> list[str]:
    """``--cfg job run.id=<id>`` shows the run's config: replay its overrides like a launch would."""
    if value_of(parse(overrides), "run.id") is None:
        return overrides
    return prepare(overrides, fix_new_id=False).overrides


def _multirun(flags: list[str], overrides: list[str]) -> int:
    parsed = parse(overrides)
    check_hydra_overrides(parsed)
    if value_of(parsed, "run.id") is not None:
        raise ConfigError("-m sweeps start a new run per point: drop run.id (continue each run on its own)")
    prepared = [prepare(point, fix_new_id=True) for point in _sweep_points(overrides)]
    if any(p.cfg.dry_run for p in prepared):
        for p in prepared:
            _print_plan(p)
        return 0
    return _call_hydra([*flags, *overrides])
