"""Crash at every counted I/O operation of each stage (SQLite-style), and injected EIO/ENOSPC.

For shard-save, verify_manifest (the commit), consolidate and export: the stage is first run with tracing to
count its I/O operations (T, see :mod:`pipeline.storage.faults`); then for each chosen N in 1..T a fresh copy of
a prepared run dir is taken, the stage "dies" at op N (no I/O from there on), and the stage (and the committer
where it matters) is rerun without faults, as a relaunch would. At every point:

* ``latest`` names a step that verifies, right after the crash and after the rerun;
* nothing under ``checkpoints/step_*``, ``consolidated/step_*`` or ``export/step_*`` is there without a marker
  or manifest that verifies (no partial output is accepted), and the step committed before is unchanged;
* the rerun completes and its outputs equal a clean run's, compared file by file (xxh3-128) over the published
  outputs — every file of ``checkpoints/step_8`` and ``checkpoints/latest`` for the commit,
  ``consolidated/step_8``, ``export/step_8``. For shard-save, whose DCP ``.metadata`` carries a random save id
  (so the marker and manifest hashing it differ too), the data files are compared byte for byte and
  ``.metadata`` by its tensor and storage tables. Stage records (times, attempt ids) are not compared.

Points are all ops at ``RELIABILITY_SCALE=large``; at ci a spread (every op that is not a plain data write,
the first and last write of each file, then evenly spaced writes) up to a per-stage cap.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.checkpoint.outputs import CONSOLIDATED_MARKER, verified_output
from pipeline.config.compose import load_config
from pipeline.config.schema import PipelineConfig
from pipeline.driver.task import execute_task
from pipeline.errors import PipelineError
from pipeline.formats.dcp import METADATA_FILE, read_metadata_safe
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import TaskContext
from pipeline.stagekit.records import read_record, sweep_record_litter
from pipeline.stages import get_stage, shard_save
from pipeline.stages.export import MARKER as EXPORT_MARKER
from pipeline.storage import faults
from pipeline.storage.atomic import is_temp_name, read_json, remove_tree
from pipeline.storage.integrity import hash_file
from pipeline.storage.layout import parse_step
from tests.reliability.conftest import record, sized
from tests.reliability.test_protocol_mutants import no_in_place_writes, renames_reach_disk

# one committer at a time, a lease acquired per crash point: the settle pause for racing committers would be a sleep
pytestmark = [pytest.mark.reliability, pytest.mark.usefixtures("no_lease_settle")]

RUN_ID = "r1"  # manifests record the run id (the run dir's name): every copy keeps it
ROOT = Path(__file__).resolve().parents[2]


# --- the prepared run dirs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bases:
    """One run, snapshotted after each stage: the start of each stage's crash points and its clean result."""

    cfg: PipelineConfig
    committed4: Path  # step 4 committed (latest=4), nothing staged
    staged8: Path  # + train resumed and staged step 8 (marker written)
    committed8: Path  # + verify_manifest: latest=8
    consolidated8: Path  # + consolidate
    exported8: Path  # + export

    def layout(self, which: str) -> RunLayout:
        return RunLayout(getattr(self, which))


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(stage: str, cfg: PipelineConfig, run_dir: Path, attempt: str | None = None) -> dict[str, object]:
    return execute_task(stage, cfg, str(run_dir), attempt or f"{stage}-{time.monotonic_ns()}")


def _snapshot(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest / RUN_ID, symlinks=True)
    return dest / RUN_ID


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Bases:
    """A real single-rank run (DDP over gloo, in this process): ~7 s on 2 cores."""
    tmp = tmp_path_factory.mktemp("crash-bases")
    cfg = load_config(
        [
            "+experiment=tiny",
            f"run.root={tmp / 'outputs'}",
            f"run.id={RUN_ID}",
            "strategy.world_size=1",
            "checkpoint.marker_deadline_s=1",
            "checkpoint.writer_threads=1",  # one writer thread: I/O ops numbered the same in every replay
        ]
    )
    run_dir = RunLayout.for_run(cfg.run.root, cfg.experiment, RUN_ID).run_dir
    _run("prepare_dirs", cfg, run_dir)
    env = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.setenv("MASTER_PORT", _free_port())
        cfg.train.stop_after_step = 4
        _run("train", cfg, run_dir, "train-a1")
        _run("verify_manifest", cfg, run_dir)
        committed4 = _snapshot(run_dir, tmp / "committed4")
        cfg.train.stop_after_step = None
        mp.setenv("MASTER_PORT", _free_port())
        _run("train", cfg, run_dir, "train-a2")
    staged8 = _snapshot(run_dir, tmp / "staged8")
    _run("verify_manifest", cfg, run_dir)
    committed8 = _snapshot(run_dir, tmp / "committed8")
    _run("consolidate", cfg, run_dir)
    consolidated8 = _snapshot(run_dir, tmp / "consolidated8")
    _run("export", cfg, run_dir)
    exported8 = _snapshot(run_dir, tmp / "exported8")
    return Bases(cfg, committed4, staged8, committed8, consolidated8, exported8)


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """``fresh(base)``: a new copy of a prepared run dir (the previous copy is deleted: disk stays small)."""
    made: list[Path] = []

    def copy(base: Path) -> Path:
        while made:
            shutil.rmtree(made.pop(), ignore_errors=True)
        dest = tmp_path / f"point-{time.monotonic_ns()}"
        made.append(dest)
        return _snapshot(base, dest)

    yield copy


# --- what must hold at every point --------------------------------------------------------------------------


def tree_hashes(root: Path) -> dict[str, str]:
    """xxh3-128 of every file under ``root`` (relative paths); a missing root is empty."""
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): hash_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def litter(run_dir: Path) -> list[str]:
    """Temp files and trash a writer that died left behind (logs/ excluded: the launcher's)."""
    out = []
    for p in run_dir.rglob("*"):
        rel = p.relative_to(run_dir)
        if rel.parts[0] == "logs":
            continue
        n = p.name
        if is_temp_name(n) or ".new-" in n or ".deleting-" in n or n.startswith(".staging-") or n.endswith(".tmp"):
            out.append(str(rel))
    return sorted(out)


def _latest_problems(layout: RunLayout, latest_in: set[int]) -> list[str]:
    try:
        latest = read_latest(layout)
    except (PipelineError, OSError, ValueError) as e:
        return [f"latest does not read: {e}"]
    if latest is None:
        return ["latest is missing"]
    if latest.step not in latest_in:
        return [f"latest names step {latest.step}, expected one of {sorted(latest_in)}"]
    try:
        verify_committed(layout.committed_step(latest.step))
    except (PipelineError, OSError) as e:
        return [f"latest names step {latest.step}, which does not verify: {e}"]
    return []


def _step_dirs(area: Path) -> list[Path]:
    return sorted(p for p in area.iterdir() if parse_step(p.name) is not None) if area.is_dir() else []


def _published_problems(layout: RunLayout) -> list[str]:
    """Published steps and outputs that do not verify (a partial step or output accepted). A step dir without
    its manifest is no committed step (the manifest, written last, commits it): no reader takes it, and a rerun
    must finish it (the comparison with a clean run's outputs says so)."""
    out: list[str] = []
    for p in _step_dirs(layout.checkpoints):
        try:
            if p.is_symlink() or not p.is_dir():
                raise PipelineError("not a directory")
            if not (p / "manifest.json").exists():
                continue
            verify_committed(p)
        except (PipelineError, OSError) as e:
            out.append(f"partial step accepted: {p.name}: {e}")
    for area, marker in ((layout.consolidated, CONSOLIDATED_MARKER), (layout.export, EXPORT_MARKER)):
        for p in _step_dirs(area):
            try:
                source = read_json(p / marker)["source"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                out.append(f"partial output published: {area.name}/{p.name} has no readable {marker}: {e}")
                continue
            if not verified_output(p, marker, source) or source.get("step") != parse_step(p.name):
                out.append(f"partial output published: {area.name}/{p.name} does not verify against {marker}")
    return out


def violations(run_dir: Path, *, latest_in: set[int], intact: dict[str, dict[str, str]]) -> list[str]:
    """Everything that breaks the crash invariants in ``run_dir`` now (empty: all hold)."""
    layout = RunLayout(run_dir)
    out = _latest_problems(layout, latest_in) + _published_problems(layout)
    out += [
        f"{rel} changed: the previous output must stay intact"
        for rel, h in intact.items()
        if tree_hashes(run_dir / rel) != h
    ]
    return out


def pick_points(trace: list[tuple[str, str]], cap: int) -> list[int]:
    """1-based op numbers to crash at: all when ``cap`` allows, else every op that is not a plain data write,
    the first and last write of each file, then evenly spaced other writes up to ``cap``."""
    total = len(trace)
    if cap >= total:
        return list(range(1, total + 1))
    must: set[int] = set()
    for i, (kind, path) in enumerate(trace, start=1):
        prev = trace[i - 2] if i > 1 else None
        nxt = trace[i] if i < total else None
        if kind != "write" or prev != (kind, path) or nxt != (kind, path):
            must.add(i)
    rest = [i for i in range(1, total + 1) if i not in must]
    room = max(0, cap - len(must))
    if rest and room:
        step = len(rest) / room
        must.update(rest[int(k * step)] for k in range(min(room, len(rest))))
    return sorted(must)


@dataclass
class Tally:
    """The figure of one stage's crash points: how many ran, of how many, and what broke."""

    total: int
    covered: int = 0
    problems: list[str] = field(default_factory=list)
    litter_points: int = 0
    litter_kinds: set[str] = field(default_factory=set)

    def add(self, point: int, found: list[str]) -> None:
        self.covered += 1
        self.problems += [f"op {point}: {v}" for v in found]

    def note_litter(self, left: list[str]) -> None:
        """Temp files a crash left outside published outputs, which the rerun did not remove (not a violation:
        nothing reads them; see the report)."""
        self.litter_points += bool(left)
        self.litter_kinds.update(re.sub(r"\.tmp-\d+-[0-9a-f]+$", ".tmp-*", x) for x in left)

    def figure(self) -> str:
        note = f"; temp litter left at {self.litter_points}" if self.litter_points else ""
        return f"{self.covered}/{self.total} points, {len(self.problems)} violations{note}"

    def notes(self) -> list[str]:
        litter_note = [f"litter never removed: {', '.join(sorted(self.litter_kinds))}"] if self.litter_kinds else []
        return self.problems[:4] + litter_note


def _crash(fn: Callable[[], Any], at: int) -> faults.IoPlan:
    """Run ``fn`` with the process "dying" at I/O op ``at``. What it raises then does not matter (DCP wraps the
    crash into a CheckpointException): the process is dead, and the plan says whether the crash happened."""
    with (
        faults.io_plan(crash_at=at) as plan,
        contextlib.suppress(faults.SimulatedCrash, CheckpointException, Exception),
    ):
        fn()
    return plan


def _rerun(stage: str, cfg: PipelineConfig, run_dir: Path) -> None:
    """What a relaunch does: sweep record litter (it holds the lease); skip a stage whose outputs verify, else run."""
    layout = RunLayout(run_dir)
    sweep_record_litter(layout)
    if get_stage(stage).is_done(cfg, layout) is None:
        _run(stage, cfg, run_dir)


# --- crash points: the single-task stages -------------------------------------------------------------------

STAGES = {
    # stage: (start, clean result, published outputs compared, intact before/after, latest steps allowed after crash)
    "verify_manifest": ("staged8", "committed8", ["checkpoints/step_8", "checkpoints/latest"], ["checkpoints/step_4"]),
    "consolidate": ("committed8", "consolidated8", ["consolidated/step_8"], ["checkpoints"]),
    "export": ("consolidated8", "exported8", ["export/step_8"], ["checkpoints", "consolidated"]),
}
CI_CAP = 150  # points per stage at ci: every point of today's stages (28-129 ops; ~1 min in all on 2 cores)


def _outputs(run_dir: Path, rels: list[str]) -> dict[str, dict[str, str]]:
    """Each output's file hashes; ``latest`` by what it names (its ``epoch`` says which committer moved it: a
    rerun after a crash is a later committer than a clean run's first)."""
    out = {}
    for rel in rels:
        p = run_dir / rel
        if p.name == "latest" and p.is_file():
            named = json.loads(p.read_text())
            named.pop("epoch", None)
            out[rel] = {"": json.dumps(named, sort_keys=True)}
        else:
            out[rel] = {"": hash_file(p)} if p.is_file() else tree_hashes(p)
    return out


@pytest.mark.parametrize("stage", list(STAGES))
def test_crash_at_every_io_op_of_a_stage(stage: str, bases: Bases, fresh: Callable[[Path], Path]) -> None:
    start_name, clean_name, compared, kept = STAGES[stage]
    cfg, start = bases.cfg, getattr(bases, start_name)
    clean = _outputs(getattr(bases, clean_name), compared)
    intact = {rel: tree_hashes(start / rel) for rel in kept}
    latest_after_crash = {4, 8} if stage == "verify_manifest" else {8}

    run_dir = fresh(start)
    with faults.tracing() as trace:
        _run(stage, cfg, run_dir)
    # The op trace obeys the publishing protocol too (checked on every stage, not only the commit).
    trace_problems = renames_reach_disk(trace, RunLayout(run_dir)) + no_in_place_writes(trace)
    points = pick_points(trace, sized(CI_CAP, len(trace)))
    tally = Tally(total=len(trace), problems=[f"trace: {p}" for p in trace_problems])
    t0 = time.monotonic()
    for n in points:
        run_dir = fresh(start)
        plan = _crash(functools.partial(_run, stage, cfg, run_dir), n)
        found = [] if plan.crashed else [f"op {n} was never reached (the stage has {len(trace)})"]
        found += [f"after the crash: {v}" for v in violations(run_dir, latest_in=latest_after_crash, intact=intact)]
        try:
            _rerun(stage, cfg, run_dir)
        except (PipelineError, OSError) as e:
            found.append(f"the rerun failed: {type(e).__name__}: {e}")
        found += [f"after the rerun: {v}" for v in violations(run_dir, latest_in={8}, intact=intact)]
        if _outputs(run_dir, compared) != clean:
            found.append(f"after the rerun {compared} differ from a clean run's")
        left = litter(run_dir)
        published = [x for x in left if any(x.startswith(rel + "/") for rel in compared)]
        found += [f"temp file inside a published output: {x}" for x in published]
        tally.note_litter(left)
        tally.add(n, found)
    seconds = time.monotonic() - t0
    record(f"crash points: {stage}", f"{tally.figure()} ({seconds:.0f}s)", ok=not tally.problems, notes=tally.notes())
    assert not tally.problems, "\n".join(tally.problems[:20])


# --- crash points: shard-save (a single-rank world, in this process) ----------------------------------------


@pytest.fixture
def save_group(bases: Bases) -> Iterator[Any]:
    """A one-rank gloo world for ``shard_save.save`` (after the bases' in-process train destroyed its own)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def _small_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(16, 8, generator=g),
            "b": torch.randn(16, generator=g),
            "frozen": torch.arange(256.0).reshape(16, 16),  # the same at every step: a shared piece
        },
        "train": {"step": torch.tensor(step)},
    }


SHARED = {"model.frozen": "frozen"}
"""Saved as a piece of its own (``__0_frozen0.distcp``): step 8 links step 6's
(``pipeline/checkpoint/save/pieces.py``)."""


def _dcp_equal(a: Path, b: Path) -> bool:
    """Same tensors and storage layout in two DCP ``.metadata`` files (their random save ids aside)."""
    ma, mb = read_metadata_safe(a), read_metadata_safe(b)
    return bool(ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data)


def _committed_save(step_dir: Path) -> dict[str, str]:
    """The comparable part of a committed DCP step: every file's hash but those that hash the save id."""
    skip = {METADATA_FILE, "manifest.json", "rank_0.done.json"}
    return {k: v for k, v in tree_hashes(step_dir).items() if k not in skip}


def _saver(bases: Bases, group: Any) -> Callable[..., shard_save.SaveResult]:
    """``save(run_dir, step=8)``: rank 0 of a one-rank world saves a small fixed state into ``run_dir``, its frozen
    tensor as a shared piece."""
    # Markers must come from the attempt that the train record names (the committer ignores others).
    attempt = str((read_record(RunLayout(bases.committed4), "train") or {})["attempt"])

    def save(run_dir: Path, step: int = 8) -> shard_save.SaveResult:
        ctx = TaskContext(cfg=bases.cfg, layout=RunLayout(run_dir), attempt=attempt, rank=0, world_size=1)
        return shard_save.save(ctx, step, _small_state(step), group, SHARED)

    return save


def test_crash_at_every_io_op_of_shard_save(  # noqa: PLR0915 - one scenario, told in order
    bases: Bases, fresh: Callable[[Path], Path], save_group: Any, tmp_path: Path
) -> None:
    """Step 6 (the small state) is committed on top of the run's step 4; step 8's save links step 6's frozen piece
    instead of writing it, and is crashed at every op: the link among them."""
    cfg = bases.cfg
    save = _saver(bases, save_group)
    start = _snapshot(bases.committed4, tmp_path / "start6")
    assert save(start, 6).ok
    _run("verify_manifest", cfg, start)
    kept = ("checkpoints/step_4", "checkpoints/step_6")
    intact = {rel: tree_hashes(start / rel) for rel in kept}

    clean_dir = fresh(start)
    with faults.tracing() as trace:
        assert save(clean_dir).ok
    _run("verify_manifest", cfg, clean_dir)
    clean_step = clean_dir.parent.parent / "clean-step_8"
    shutil.copytree(clean_dir / "checkpoints/step_8", clean_step)
    clean = _committed_save(clean_step)
    assert set(clean) == {"__0_0.distcp", "__0_frozen0.distcp"}, clean
    assert [k for k, p in trace if Path(p).name == "__0_frozen0.distcp"][:1] == ["link"], "the piece is linked"
    assert (clean_dir / "checkpoints/step_8/__0_frozen0.distcp").stat().st_nlink == 2

    trace_problems = renames_reach_disk(trace, RunLayout(clean_dir)) + no_in_place_writes(trace)
    points = pick_points(trace, sized(CI_CAP, len(trace)))
    tally = Tally(total=len(trace), problems=[f"trace: {p}" for p in trace_problems])
    t0 = time.monotonic()
    for n in points:
        run_dir = fresh(start)
        layout = RunLayout(run_dir)
        plan = _crash(functools.partial(save, run_dir), n)
        found = [] if plan.crashed else [f"op {n} was never reached (the save has {len(trace)})"]
        found += [f"after the crash: {v}" for v in violations(run_dir, latest_in={6}, intact=intact)]
        try:  # the committer runs after a failed train too (afterany)
            _run("verify_manifest", cfg, run_dir)
        except PipelineError as e:
            if "done-marker" not in str(e):
                found.append(f"the committer failed for another reason than the missing marker: {e}")
        found += [f"after the commit: {v}" for v in violations(run_dir, latest_in={6, 8}, intact=intact)]
        if layout.quarantine.is_dir() and any(layout.quarantine.iterdir()):
            found.append("a crashed save produced a complete-looking step that failed verification (quarantined)")
        latest = read_latest(layout)
        if latest is not None and latest.step == 6:  # the relaunched train saves step 8 again
            if not save(run_dir).ok:
                found.append("the re-save failed")
            try:
                _run("verify_manifest", cfg, run_dir)
            except PipelineError as e:
                found.append(f"the commit after the re-save failed: {e}")
        found += [f"after the rerun: {v}" for v in violations(run_dir, latest_in={8}, intact=intact)]
        step8 = layout.committed_step(8)
        if _committed_save(step8) != clean or not _dcp_equal(step8, clean_step):
            found.append("the committed step 8 differs from a clean save's")
        left = litter(run_dir)
        found += [f"temp file inside the committed step: {x}" for x in left if x.startswith("checkpoints/step_8/")]
        tally.note_litter(left)
        tally.add(n, found)
    seconds = time.monotonic() - t0
    figure = f"{tally.figure()} ({seconds:.0f}s)"
    record("crash points: shard_save + commit", figure, ok=not tally.problems, notes=tally.notes())
    assert not tally.problems, "\n".join(tally.problems[:20])


def test_io_error_in_shard_save_fails_only_that_save(
    bases: Bases, fresh: Callable[[Path], Path], save_group: Any
) -> None:
    run_dir = fresh(bases.committed4)
    assert not bases.cfg.checkpoint.fail_on_save_error
    with faults.io_plan(fail_kind="write", fail_path="__0_0.distcp", errno=errno.ENOSPC):
        result = _saver(bases, save_group)(run_dir)
    assert not result.ok, "the save must report failure (no marker), and training goes on"
    assert not violations(run_dir, latest_in={4}, intact={})


# --- injected I/O errors: EIO / ENOSPC on write, fsync and rename -------------------------------------------

ERROR_STAGES = {
    # stage: (start, the area whose ops get errors, latest before, step that the stage makes)
    "verify_manifest": ("staged8", "checkpoints", 4),
    "consolidate": ("committed8", "consolidated", 8),
}


def _error_points(trace: list[tuple[str, str]], area: Path, cap: int) -> list[tuple[int, str]]:
    """(op number, kind) of the ops in ``area`` of kinds write/fsync/fsync_dir/rename: all, or a spread of
    ``cap`` (all non-writes, first and last write of each file)."""
    idx = [i for i, (kind, path) in enumerate(trace, start=1) if kind != "unlink" and Path(path).is_relative_to(area)]
    sub = [trace[i - 1] for i in idx]
    chosen = {idx[j - 1] for j in pick_points(sub, cap)}
    return [(i, trace[i - 1][0]) for i in sorted(chosen)]


@pytest.mark.parametrize("stage", list(ERROR_STAGES))
def test_injected_io_errors_fail_in_one_line_and_a_rerun_completes(
    stage: str, bases: Bases, fresh: Callable[[Path], Path]
) -> None:
    start_name, area_name, latest_before = ERROR_STAGES[stage]
    cfg, start = bases.cfg, getattr(bases, start_name)
    intact = {"checkpoints/step_4": tree_hashes(start / "checkpoints/step_4")}
    if stage == "consolidate":
        intact = {"checkpoints": tree_hashes(start / "checkpoints")}
    run_dir = fresh(start)
    with faults.tracing() as trace:
        _run(stage, cfg, run_dir)
    latest_rename = next((i for i, (k, p) in enumerate(trace, 1) if k == "rename" and p.endswith("/latest")), None)
    points = _error_points(trace, run_dir / area_name, sized(24, len(trace)))
    problems: list[str] = []
    kinds: set[str] = set()
    for n, kind in points:
        for code in (errno.EIO, errno.ENOSPC):
            run_dir = fresh(start)
            layout = RunLayout(run_dir)
            where = f"{errno.errorcode[code]} at op {n} ({kind})"
            with faults.io_plan(fail_at=n, errno=code):
                try:
                    _run(stage, cfg, run_dir)
                    error: BaseException | None = None
                except (OSError, PipelineError) as e:
                    error = e
            if error is None:
                problems.append(f"{where}: the stage succeeded")
                continue
            kinds.add(kind)
            message = str(error)
            rec = read_record(layout, stage) or {}
            if "\n" in message or os.strerror(code) not in message:
                problems.append(f"{where}: the error is not one line naming the cause: {message!r}")
            if rec.get("status") != "failed" or os.strerror(code) not in str(rec.get("error", "")):
                problems.append(f"{where}: the stage record does not say failed with the cause: {rec.get('error')!r}")
            # An fsync of checkpoints/ after latest's rename fails the commit, but latest has moved (and verifies).
            after_latest = latest_rename is not None and n > latest_rename
            allowed = {latest_before, 8} if after_latest else {latest_before}
            problems += [f"{where}: {v}" for v in violations(run_dir, latest_in=allowed, intact=intact)]
            try:
                _rerun(stage, cfg, run_dir)
            except (PipelineError, OSError) as e:
                problems.append(f"{where}: the rerun failed: {e}")
            problems += [f"{where}: after the rerun: {v}" for v in violations(run_dir, latest_in={8}, intact=intact)]
            problems += [f"{where}: litter after the rerun: {x}" for x in litter(run_dir)]
    figure = f"{len(points) * 2} injections ({', '.join(sorted(kinds))} x EIO/ENOSPC), {len(problems)} violations"
    record(f"injected I/O errors: {stage}", figure, ok=not problems, notes=problems)
    assert not problems, "\n".join(problems[:20])
    assert {"write", "fsync", "rename"} <= kinds


# --- the environment switches, in a real subprocess ---------------------------------------------------------

_SUBPROCESS = textwrap.dedent(
    """
    import sys
    from pipeline.config.compose import load_config
    from pipeline.driver.task import execute_task
    cfg = load_config(["+experiment=tiny", "run.root=" + sys.argv[2], "run.id=r1", "strategy.world_size=1",
                       "checkpoint.marker_deadline_s=1"])
    try:
        execute_task("verify_manifest", cfg, sys.argv[1], "verify-subprocess")
    except OSError as e:
        print(f"FAILED: {e}")
        sys.exit(1)
    """
)


def test_env_switches_crash_and_fail_a_subprocess(bases: Bases, tmp_path: Path) -> None:
    """``PIPELINE_CRASH_AT_OP`` kills the task with exit 17 at that op; ``PIPELINE_IO_ERROR`` fails the op."""
    probe = _snapshot(bases.staged8, tmp_path / "probe")
    with faults.tracing() as trace:
        _run("verify_manifest", bases.cfg, probe)
    published = str(RunLayout(probe).committed_step(8))
    after_publish = next(i for i, op in enumerate(trace, start=1) if op == ("rename", published)) + 1
    results = []
    for name, env in (
        ("crash", {faults.CRASH_ENV: str(after_publish)}),  # step 8 is published, latest not moved yet
        ("error", {faults.IO_ERROR_ENV: "kind=rename,path=checkpoints/latest,errno=ENOSPC"}),
    ):
        run_dir = _snapshot(bases.staged8, tmp_path / name)
        proc = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS, str(run_dir), str(tmp_path)],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        latest = read_latest(RunLayout(run_dir))
        results.append((name, proc.returncode, latest.step if latest else None, proc.stdout.strip()))
        assert not violations(run_dir, latest_in={4}, intact={}), (name, proc.stderr[-2000:])
        _run("verify_manifest", bases.cfg, run_dir)  # the rerun, in this process without faults, completes
        assert not violations(run_dir, latest_in={8}, intact={}), name
    (_, crash_rc, crash_latest, _), (_, error_rc, error_latest, error_out) = results
    assert crash_rc == faults.CRASH_EXIT_CODE and crash_latest == 4, results
    assert error_rc == 1 and error_latest == 4 and "No space left on device" in error_out, results
    assert len(error_out.splitlines()) == 1, error_out


def test_plan_from_env_parses_and_refuses() -> None:
    plan = faults.plan_from_env({faults.IO_ERROR_ENV: "kind=fsync,errno=EIO,nth=2"})
    assert plan is not None and plan.fail_kind == "fsync" and plan.fail_nth == 2 and plan.errno == errno.EIO
    plan = faults.plan_from_env({faults.IO_ERROR_ENV: "op=7,errno=ENOSPC", faults.CRASH_ENV: "9"})
    assert plan is not None and plan.fail_at == 7 and plan.errno == errno.ENOSPC and plan.crash_at == 9
    assert faults.plan_from_env({}) is None
    for bad in ("op=x", "errno=EIO", "kind=frobnicate", "op=1,kind=write", "op=1,errno=ENOTANERRNO", "op=1,x=2"):
        with pytest.raises(ValueError, match=faults.IO_ERROR_ENV):
            faults.plan_from_env({faults.IO_ERROR_ENV: bad})
    with pytest.raises(ValueError, match=faults.CRASH_ENV):
        faults.plan_from_env({faults.CRASH_ENV: "0"})


# --- remove_tree: concurrent removers, and a remover that dies mid-delete -----------------------------------


def _fill(root: Path, n_files: int = 120) -> None:
    for i in range(n_files):
        sub = root / f"d{i % 6}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.bin").write_bytes(b"x" * 64)


def test_remove_tree_tolerates_concurrent_removers_and_clears_dead_trash(tmp_path: Path) -> None:
    target = tmp_path / ".staging-step_8"
    rounds, removers, errors = sized(10, 100), 4, []
    for _ in range(rounds):
        _fill(target)
        barrier = threading.Barrier(removers)

        def remove(barrier: threading.Barrier = barrier) -> None:
            barrier.wait(10)
            try:
                remove_tree(target)
            except OSError as e:
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=remove) for _ in range(removers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not target.exists()
    trash_left = [p.name for p in tmp_path.iterdir()]
    # A remover that dies after renaming the tree aside leaves trash; the next removal of that name clears it.
    _fill(target)
    plan = _crash(functools.partial(remove_tree, target), 3)  # ops: rename aside, fsync_dir, rmtree
    dead_trash = [p.name for p in tmp_path.iterdir()]
    _fill(target)
    remove_tree(target)
    after = [p.name for p in tmp_path.iterdir()]
    figure = f"{rounds} rounds x {removers} removers, {len(errors)} errors; dead remover's trash cleared: {not after}"
    record("remove_tree: concurrent and crashed removers", figure, ok=not errors and not after, notes=errors[:3])
    assert not errors, errors[:5]
    assert not trash_left, trash_left
    assert plan.crashed and len(dead_trash) == 1 and ".deleting-" in dead_trash[0], dead_trash
    assert not after, after
