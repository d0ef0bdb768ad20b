"""The runner: fixes the run once, walks the stage DAG, skips stages whose outputs verify, launches the rest."""

from __future__ import annotations

import os
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.checkpoint.manifest import read_latest
from pipeline.config.schema import STAGE_ALL, PipelineConfig
from pipeline.errors import ConfigError, PipelineError, RunNotFoundError
from pipeline.orchestration.contract import StageContract
from pipeline.stages import ORDER, get_stage
from pipeline.storage.layout import RunLayout

if TYPE_CHECKING:
    from launchers.base import Launcher


@dataclass(frozen=True)
class StageJob:
    """One stage launch: everything a launcher needs, decided before the job starts."""

    stage: str
    contract: StageContract
    cfg: PipelineConfig
    layout: RunLayout
    attempt: str


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def plan(cfg: PipelineConfig) -> list[str]:
    if cfg.stage == STAGE_ALL:
        if cfg.force:
            raise ConfigError("force=true redoes one stage: add stage=<name> (one of " + ", ".join(ORDER) + ")")
        return list(ORDER)
    if cfg.stage == "shard_save":
        raise ConfigError("shard_save runs inside train on every rank: rerun stage=train instead")
    if cfg.stage not in ORDER:
        raise RunNotFoundError(f"unknown stage {cfg.stage!r}: choose one of {', '.join(ORDER)} or all")
    return [cfg.stage]


def resolve_layout(cfg: PipelineConfig) -> RunLayout:
    if cfg.stage != STAGE_ALL and not cfg.run.id:
        raise ConfigError(f"stage={cfg.stage} reruns one stage of an existing run: add run.id=<id>")
    layout = RunLayout.for_run(cfg.run.root, cfg.experiment, cfg.run.id or new_run_id())
    if cfg.stage not in (STAGE_ALL, "prepare_dirs") and not layout.run_yaml.exists():
        raise RunNotFoundError(f"unknown run id {layout.run_id!r}: {layout.run_yaml} does not exist")
    return layout


def run(cfg: PipelineConfig, launcher: Launcher, say: Callable[[str], None] = print) -> RunLayout:
    stages = plan(cfg)
    layout = resolve_layout(cfg)
    if cfg.run.id is None:
        cfg.run.id = layout.run_id  # decided once, here; every job receives it
    say(f"run {layout.run_id}: {layout.run_dir}")
    layout.logs.mkdir(parents=True, exist_ok=True, mode=0o700)  # owner: this process; job folders hold pickles
    os.chmod(layout.logs, 0o700)
    failure: PipelineError | None = None
    for name in stages:
        module = get_stage(name)
        if failure is not None and not module.CONTRACT.after_any:
            say(f"skip {name}: an earlier stage failed")
            continue
        done = None if (cfg.force or (name == "prepare_dirs" and cfg.run.overwrite)) else module.is_done(cfg, layout)
        if done:
            say(f"skip {name}: {done}")
            continue
        say(f"run  {name} ({module.CONTRACT.num_tasks(cfg)} task(s))")
        t0 = time.monotonic()
        try:
            launcher.run_stage(StageJob(name, module.CONTRACT, cfg, layout, f"{name}-{uuid.uuid4().hex[:10]}"))
        except PipelineError as e:
            say(f"FAIL {name} after {time.monotonic() - t0:.1f}s: {str(e).splitlines()[0]}")
            failure = failure or e
            continue
        say(f"done {name} in {time.monotonic() - t0:.1f}s")
    summarize(layout, say)
    if failure is not None:
        raise failure
    return layout


def summarize(layout: RunLayout, say: Callable[[str], None]) -> None:
    latest = read_latest(layout) if layout.latest.exists() else None
    if latest is None:
        say("no committed step yet")
        return
    step_dir = layout.committed_step(latest.step)
    say(f"manifest: {step_dir / 'manifest.json'}")
    say(f"latest:   {layout.latest} -> step {latest.step}")
    if layout.export_step(latest.step).exists():
        say(f"export:   {layout.export_step(latest.step)}")
