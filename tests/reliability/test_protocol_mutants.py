"""Meta-test: the commit code with one safety step removed fails at least one protocol check.

The protocol checks are plain functions over a committer run (``verify_manifest`` on a run with step 4
committed and step 8 staged by two fake ranks), most of them reading the I/O op trace of
:mod:`pipeline.storage.faults`:

* ``durable_publish`` — a published directory's files and the directory itself are fsynced before the rename
  that publishes it, and every rename is followed by an fsync of the destination's parent (before ``latest``
  moves, for renames before that);
* ``verified_before_latest`` — every file of the step was hashed before ``latest`` moves, and ``latest`` moves
  only after the step directory is published;
* ``corrupt_step_never_latest`` — a staged file whose bytes differ from its marker never becomes ``latest``;
* ``no_in_place_writes`` — no file is written under its final name outside a staging area (always temp +
  rename);
* ``bounded_marker_wait`` — a missing marker fails within the deadline while the producer looks alive (run in
  a thread with a timeout, so an unbounded wait fails the check instead of hanging the suite);
* ``planted_symlink_refused`` — ``checkpoints/staging/step_8`` planted as a symlink to a directory outside is
  never published, and nothing is written through it.

Mutants (monkeypatched, each removing one safety step): fsync_dir a no-op; file verification a no-op;
``latest`` replaced before the step is published; in-place overwrite instead of temp + rename; a marker wait
that ignores its deadline; ``lstat``-based symlink checks that follow links.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.config.compose import load_config
from pipeline.config.schema import PipelineConfig
from pipeline.driver.task import execute_task
from pipeline.errors import DeadlineError, PipelineError
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.records import write_record
from pipeline.storage import atomic, faults, integrity, waiting
from pipeline.storage.atomic import is_temp_name
from pipeline.storage.layout import parse_step
from tests import seed_helpers as sh
from tests.reliability.conftest import record

pytestmark = [pytest.mark.reliability]

Trace = list[tuple[str, str]]
WORLD = 2
ATTEMPT = "train-mutants"
DEADLINE_S = 0.5
WAIT_BOUND_S = DEADLINE_S + 8.0  # generous for a loaded 2-core machine; the unmutated wait ends in ~0.5 s


# --- trace checks (also applied to every stage's trace by test_crash_points) ----------------------------------


def _in_staging(path: str) -> bool:
    parts = Path(path).parts
    return any(p.startswith(".staging-") for p in parts) or any(
        a == "checkpoints" and b == "staging" for a, b in zip(parts, parts[1:], strict=False)
    )


def no_in_place_writes(trace: Trace) -> list[str]:
    """Every write goes to a temp name, or into a staging area that is published by one rename."""
    out = []
    for i, (kind, path) in enumerate(trace, start=1):
        name = Path(path).name
        temp = is_temp_name(name) or ".new-" in name or name.endswith(".tmp")
        if kind == "write" and not temp and not _in_staging(path):
            out.append(f"op {i}: {path} is written in place under its final name (not temp + rename)")
    return sorted(set(out))


def _staged_source(layout: RunLayout, published: Path) -> Path | None:
    """Where a published step directory was built (the layout's naming), or None for other renames."""
    step = parse_step(published.name)
    if step is None:
        return None
    if published.parent == layout.checkpoints:
        return layout.staged_step(step)
    if published.parent in (layout.consolidated, layout.export):
        return published.parent / f".staging-{published.name}"
    return None


def renames_reach_disk(trace: Trace, layout: RunLayout) -> list[str]:
    """Each rename is followed by an fsync of the destination's parent (before ``latest`` is next renamed);
    a published step directory's files and the directory itself are fsynced before the rename (a file renamed
    into it after, the step's manifest, is checked as a link or rename of its own)."""
    out = []
    latest_at = [i for i, (k, p) in enumerate(trace) if k == "rename" and Path(p) == layout.latest]
    for i, (kind, path) in enumerate(trace):
        if kind not in ("rename", "link"):
            continue
        dest = Path(path)
        limit = next((j for j in latest_at if j > i), len(trace))
        if ("fsync_dir", str(dest.parent)) not in trace[i + 1 : limit]:
            before = " before latest moves" if limit < len(trace) else ""
            out.append(f"op {i + 1}: the rename onto {dest} is not followed by an fsync of {dest.parent}{before}")
        staged = _staged_source(layout, dest)
        if staged is None or not dest.is_dir():
            continue
        synced = set(trace[:i])
        later = {Path(p) for k, p in trace[i + 1 :] if k in ("rename", "link")}  # the manifest, written last
        files = [p.relative_to(dest) for p in dest.rglob("*") if p.is_file() and p not in later]
        unsynced = [str(f) for f in files if ("fsync", str(staged / f)) not in synced]
        if unsynced:
            out.append(f"op {i + 1}: {dest} is published before its files were fsynced: {', '.join(unsynced)}")
        if ("fsync_dir", str(staged)) not in synced:
            out.append(f"op {i + 1}: {dest} is published before its directory {staged} was fsynced")
    return out


# --- the committer's run dir ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Step 4 committed, step 8 staged by both fake ranks (markers written), in ``base``."""

    cfg: PipelineConfig
    base: Path
    tmp: Path

    def copy(self) -> RunLayout:
        dest = self.tmp / f"run-{time.monotonic_ns()}" / self.base.name
        shutil.copytree(self.base, dest, symlinks=True)
        return RunLayout(dest)

    def commit(self, layout: RunLayout) -> PipelineError | None:
        """Run the committer; its PipelineError (an expected refusal) is returned, not raised."""
        try:
            execute_task("verify_manifest", self.cfg, str(layout.run_dir), f"verify-{time.monotonic_ns()}")
        except PipelineError as e:
            return e
        return None


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    tmp = tmp_path_factory.mktemp("mutants")
    cfg = load_config(
        [
            "+experiment=tiny",
            f"run.root={tmp / 'outputs'}",
            "run.id=m1",
            f"strategy.world_size={WORLD}",
            f"checkpoint.marker_deadline_s={DEADLINE_S}",
        ]
    )
    layout = RunLayout.for_run(cfg.run.root, cfg.experiment, "m1")
    execute_task("prepare_dirs", cfg, str(layout.run_dir), "prepare-dirs-mutants")
    for rank in range(WORLD):
        sh.stage_rank(layout, 4, rank, world=WORLD, attempt=ATTEMPT)
    execute_task("verify_manifest", cfg, str(layout.run_dir), "verify-mutants")
    for rank in range(WORLD):
        sh.stage_rank(layout, 8, rank, world=WORLD, attempt=ATTEMPT)
    return Setup(cfg, layout.run_dir, tmp)


def _latest_step(layout: RunLayout) -> int | None:
    try:
        latest = read_latest(layout)
    except (PipelineError, OSError, ValueError):
        return None
    return latest.step if latest else None


# --- the checks ---------------------------------------------------------------------------------------------


def check_durable_publish(s: Setup) -> list[str]:
    layout = s.copy()
    with faults.tracing() as trace:
        s.commit(layout)
    return renames_reach_disk(trace, layout) or (
        [] if _latest_step(layout) == 8 else [f"the commit did not move latest to 8 ({_latest_step(layout)})"]
    )


def check_verified_before_latest(s: Setup) -> list[str]:
    layout = s.copy()
    staged, final = layout.staged_step(8), layout.committed_step(8)
    real_hash = integrity.hash_file
    with faults.tracing() as trace, pytest.MonkeyPatch.context() as mp:

        def hash_file(path: Path) -> str:
            trace.append(("hash", str(path)))
            return real_hash(path)

        mp.setattr(integrity, "hash_file", hash_file)
        s.commit(layout)
    latest_at = next((i for i, (k, p) in enumerate(trace) if k == "rename" and Path(p) == layout.latest), None)
    if latest_at is None:
        return ["latest was never replaced: the step was not committed"]
    out = []
    publish_at = next((i for i, (k, p) in enumerate(trace) if k == "rename" and Path(p) == final), None)
    if publish_at is None or publish_at > latest_at:
        out.append(f"latest moved (op {latest_at + 1}) before {final} was published (op {publish_at})")
    hashed = {Path(p) for k, p in trace[:latest_at] if k == "hash"}
    try:
        files = [f.path for f in read_manifest(final).files]
    except (PipelineError, OSError) as e:
        return out + [f"no manifest to check against: {e}"]
    missing = [f for f in files if staged / f not in hashed and final / f not in hashed]
    if missing:
        out.append(f"latest moved before these files were hashed against their markers: {', '.join(missing)}")
    return out


def check_corrupt_step_never_latest(s: Setup) -> list[str]:
    layout = s.copy()
    victim = layout.staged_step(8) / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF  # same size, different bytes: only the hash can tell
    victim.write_bytes(bytes(data))
    error = s.commit(layout)
    out = []
    if _latest_step(layout) != 4:
        out.append(f"a step with a corrupt file became latest (latest -> {_latest_step(layout)})")
    if os.path.lexists(layout.committed_step(8)):
        out.append("a step with a corrupt file was published")
    if error is None or "__1_0.distcp" not in str(error):
        out.append(f"the committer did not fail naming the corrupt file: {error}")
    return out


def check_no_in_place_writes(s: Setup) -> list[str]:
    layout = s.copy()
    with faults.tracing() as trace:
        s.commit(layout)
    return no_in_place_writes(trace)


CANCEL_WAIT = threading.Event()
"""Set by the wait check when it gives up, so that an unbounded (mutant) wait in its thread can end."""


def check_bounded_marker_wait(s: Setup) -> list[str]:
    layout = s.copy()
    (layout.staged_step(8) / "rank_1.done.json").unlink()
    write_record(layout, "train", status="running", attempt=ATTEMPT, pid=os.getpid())  # the producer is alive
    outcome: list[BaseException | None] = []
    thread = threading.Thread(target=lambda: outcome.append(s.commit(layout)), daemon=True)
    t0 = time.monotonic()
    thread.start()
    thread.join(WAIT_BOUND_S)
    if thread.is_alive():
        CANCEL_WAIT.set()
        thread.join(10)
        CANCEL_WAIT.clear()
        return [f"a missing marker was still awaited after {WAIT_BOUND_S:g}s (deadline {DEADLINE_S:g}s)"]
    took = time.monotonic() - t0
    error = outcome[0] if outcome else None
    if error is None or "rank(s) 1" not in str(error):
        return [f"the wait ended in {took:.1f}s without naming the missing rank 1: {error}"]
    return []


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def check_planted_symlink_refused(s: Setup) -> list[str]:
    layout = s.copy()
    outside = layout.run_dir.parent / "outside" / "step_8"
    outside.parent.mkdir()
    shutil.move(layout.staged_step(8), outside)  # a complete, valid step, but outside the run dir
    os.symlink(outside, layout.staged_step(8))
    before = _tree(outside)
    s.commit(layout)
    out = []
    final = layout.committed_step(8)
    if os.path.lexists(final):
        out.append(f"the planted link was published as {final} ({'a symlink' if final.is_symlink() else 'a copy'})")
    if _latest_step(layout) == 8:
        out.append("latest names the step behind the planted link")
    if _tree(outside) != before:
        out.append(f"the committer wrote through the planted link into {outside}")
    for p in layout.checkpoints.rglob("*"):
        if p.is_symlink() and layout.quarantine not in p.parents:
            out.append(f"{p} is a symlink outside quarantine/")
    return out


CHECKS: dict[str, Callable[[Setup], list[str]]] = {
    "durable_publish": check_durable_publish,
    "verified_before_latest": check_verified_before_latest,
    "corrupt_step_never_latest": check_corrupt_step_never_latest,
    "no_in_place_writes": check_no_in_place_writes,
    "bounded_marker_wait": check_bounded_marker_wait,
    "planted_symlink_refused": check_planted_symlink_refused,
}


def run_checks(s: Setup) -> dict[str, list[str]]:
    """Each check's problems (empty: it passes); a check that raises counts as failing, with the exception."""
    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(s)
        except Exception as e:  # a mutant can break the committer in unforeseen ways: that is a caught mutant
            results[name] = [f"the check raised {type(e).__name__}: {e}"]
    return results


# --- the mutants ----------------------------------------------------------------------------------------------


class MutantUnavailable(Exception):
    """The safety step a mutant removes is not in the code (yet)."""


def patch_everywhere(mp: pytest.MonkeyPatch, original: Any, replacement: Any) -> int:
    """Replace ``original`` under every name a ``pipeline`` module bound it to; returns how many were replaced."""
    n = 0
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("pipeline") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                mp.setattr(mod, attr, replacement)
                n += 1
    return n


def mutant_fsync_dir_noop(mp: pytest.MonkeyPatch) -> None:
    patch_everywhere(mp, atomic.fsync_dir, lambda path: None)


def mutant_verification_noop(mp: pytest.MonkeyPatch) -> None:
    patch_everywhere(mp, integrity.verify_entries, lambda *args, **kwargs: None)


def mutant_latest_before_publish(mp: pytest.MonkeyPatch) -> None:
    """The commit's last two steps swapped: ``latest`` is replaced, then the step directory is published."""
    from pipeline.checkpoint.stores import posix_store  # noqa: PLC0415
    from pipeline.storage.backend import PosixStorage  # noqa: PLC0415

    pending: list[tuple[Any, ...]] = []
    real_publish, real_latest = PosixStorage.publish, posix_store.write_latest

    def deferred_publish(*args: Any) -> None:
        pending.append(args)

    def latest_then_publish(*args: Any, **kwargs: Any) -> None:
        real_latest(*args, **kwargs)
        while pending:
            real_publish(*pending.pop(0))

    mp.setattr(PosixStorage, "publish", deferred_publish)
    mp.setattr(posix_store, "write_latest", latest_then_publish)


def mutant_in_place_overwrite(mp: pytest.MonkeyPatch) -> None:
    def in_place(path: Path, data: bytes, mode: int = 0o644) -> None:
        faults.io_op("write", path)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            faults.io_op("fsync", path)
            os.fsync(f.fileno())
        atomic.fsync_dir(Path(path).parent)

    patch_everywhere(mp, atomic.write_bytes_atomic, in_place)


def mutant_untimed_wait(mp: pytest.MonkeyPatch) -> None:
    def untimed(poll: Callable[[], Any], *, interval_s: float = 0.05, **_ignored: Any) -> Any:
        while not CANCEL_WAIT.is_set():  # the deadline and the liveness check are gone
            result = poll()
            if result is not None:
                return result
            time.sleep(interval_s)
        raise DeadlineError("cancelled by the test (the mutant would have waited forever)")

    patch_everywhere(mp, waiting.wait_until, untimed)


def mutant_symlink_followed(mp: pytest.MonkeyPatch) -> None:
    """The lstat-based checks (``integrity.lstat_kind`` / ``is_real_dir``) follow links, as ``stat`` does."""
    lstat_kind = getattr(integrity, "lstat_kind", None)
    is_real_dir = getattr(integrity, "is_real_dir", None)
    if lstat_kind is None or is_real_dir is None:
        raise MutantUnavailable("pipeline.storage.integrity has no lstat_kind/is_real_dir symlink checks yet")

    def following_kind(path: Path) -> str | None:
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"

    patch_everywhere(mp, lstat_kind, following_kind)
    patch_everywhere(mp, is_real_dir, lambda path: following_kind(path) == "dir")


MUTANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "fsync_dir no-op": mutant_fsync_dir_noop,
    "no verification": mutant_verification_noop,
    "latest before publish": mutant_latest_before_publish,
    "in-place overwrite": mutant_in_place_overwrite,
    "untimed wait": mutant_untimed_wait,
    "symlink followed": mutant_symlink_followed,
}


@contextmanager
def mutated(name: str) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        MUTANTS[name](mp)
        yield


# --- the meta-tests -------------------------------------------------------------------------------------------

_CAUGHT: dict[str, list[str]] = {}  # mutant -> the checks that failed under it
_UNMUTATED_OK: list[bool] = []


@pytest.fixture(scope="module", autouse=True)
def _scenario_row() -> Iterator[None]:
    yield
    if not _CAUGHT:
        return
    caught = sorted(name for name, checks in _CAUGHT.items() if checks)
    each = [f"{name} <- {', '.join(checks) or 'NOTHING'}" for name, checks in _CAUGHT.items()]
    notes = ["; ".join(each[i : i + 2]) for i in range(0, len(each), 2)]  # the table shows up to 5 note lines
    ok = len(caught) == len(_CAUGHT) and all(_UNMUTATED_OK)
    clean = "" if all(_UNMUTATED_OK) else "; the unmutated code FAILS a check"
    record("protocol mutants caught", f"{len(caught)}/{len(_CAUGHT)}{clean}", ok=ok, notes=notes)


def test_unmutated_code_passes_every_check(setup: Setup) -> None:
    results = run_checks(setup)
    failing = {name: problems for name, problems in results.items() if problems}
    _UNMUTATED_OK.append(not failing)
    assert not failing, failing


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mutant_fails_at_least_one_check(setup: Setup, mutant: str) -> None:
    try:
        with mutated(mutant):
            results = run_checks(setup)
    except MutantUnavailable as e:
        pytest.xfail(str(e))
    caught = [name for name, problems in results.items() if problems]
    _CAUGHT[mutant] = caught
    assert caught, f"mutant '{mutant}' passed every protocol check"
