"""Helpers of the reliability suite: launch the CLI as a user would, check a run's invariants, find leftovers.

Every launch runs ``python -m pipeline`` in a session of its own (like a launch from a supervisor), with its
stdout and stderr in files outside the run root (a full disk must not swallow what the launcher said).
:func:`check_run` states the invariants every scenario ends with; it returns the violations as sentences, so
a scenario can count them for its figure before it asserts.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from launchers.local_forks import forked_tasks
from pipeline.checkpoint.manifest import MANIFEST, read_latest, verify_committed
from pipeline.config.identity import read_run_record
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import read_json
from pipeline.storage.integrity import hash_file
from pipeline.storage.layout import parse_step
from tests.conftest import ROOT
from tests.s3.server import SERVICE_PIDS

TRACEBACK = "Traceback (most recent call last)"
LITTER = ("*.tmp-*", ".staging-*", ".*.deleting-*", ".*.new-*")
"""Names of half-done writes (atomic.py's temp files, output staging dirs, deletions, lease temp files)."""

BASE_ID = "base"
BASE_STEPS = 8
FAST = ("launcher.poll_interval_s=0.2",)
"""Per-launch keys every launch of the suite adds (a quicker poll: the suite waits less)."""


def seeded_rng(name: str) -> tuple[random.Random, int]:
    """A random source for one scenario: ``RELIABILITY_SEED`` if set, else a fresh seed; printed either way."""
    seed = int(os.environ.get("RELIABILITY_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"{name}: seed {seed} (rerun with RELIABILITY_SEED={seed})")
    return random.Random(seed), seed


# --- launching --------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """One ``python -m pipeline`` process and the files its output goes to."""

    proc: subprocess.Popen[bytes]
    args: list[str]
    out_path: Path
    err_path: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def output(self) -> str:
        return f"$ {' '.join(self.args)}\n--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr}"

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.pid)
            self.proc.wait(timeout=30)
            raise AssertionError(f"launch did not end within {timeout:g}s (killed):\n{self.output}") from None

    def running(self) -> bool:
        return self.proc.poll() is None


_launches = iter(range(1, 1 << 30))  # numbers the console files of the session's launches


def launch(
    root: Path,
    run_id: str,
    *overrides: str,
    logs: Path,
    create: bool = False,
    umask: int = -1,
    preexec_fn: Callable[[], None] | None = None,
) -> Launch:
    """Start ``python -m pipeline run.root=<root> run.id=<run_id> ...`` in a new session (not waited for)."""
    n = next(_launches)
    args = [*(["+experiment=tiny"] if create else []), f"run.root={root}", f"run.id={run_id}"]
    args += [*(["run.create=true"] if create else []), *FAST, *overrides]
    logs.mkdir(parents=True, exist_ok=True)
    out_path, err_path = logs / f"launch{n}.out", logs / f"launch{n}.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            umask=umask,
            preexec_fn=preexec_fn,  # noqa: PLW1509 - rlimits for the launch; the suite starts no threads
        )
    return Launch(proc, ["python", "-m", "pipeline", *args], out_path, err_path)


def run(root: Path, run_id: str, *overrides: str, logs: Path, timeout: float = 300, **kw: Any) -> Launch:
    """:func:`launch` and wait for it."""
    started = launch(root, run_id, *overrides, logs=logs, **kw)
    started.wait(timeout)
    return started


# --- the shared base run ---------------------------------------------------------------------------------

_base: dict[str, Path] = {}  # "root": where the session's base run was made; "shared": see share_base_run_in


def share_base_run_in(directory: Path) -> None:
    """Make the base run under ``directory`` (once, by whichever process comes first, under a lock): every process
    given the same directory, as the pytest-xdist workers of one session are, copies that one run instead of
    making its own."""
    _base["shared"] = directory


def _make_base(logs: Path) -> Path:
    """Launch the base run into a new root: the session's shared one (made once, see :func:`share_base_run_in`),
    else a temp dir removed at exit."""
    if "shared" not in _base:
        made = Path(tempfile.mkdtemp(prefix="reliability-base-"))
        atexit.register(shutil.rmtree, made, ignore_errors=True)
        _launch_base(made, logs)
        return made
    shared = _base["shared"] / "reliability-base"
    shared.mkdir(parents=True, exist_ok=True)
    made, done = shared / "root", shared / "made"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process making it: wait for it (a launch ends within 300 s)
        if not done.exists():
            shutil.rmtree(made, ignore_errors=True)  # what a failed attempt left
            made.mkdir()
            _launch_base(made, logs)
            done.write_text(f"pid {os.getpid()}\n")
    return made


def _launch_base(root: Path, logs: Path) -> None:
    # A frozen layer: every save after the first links its piece (pipeline/checkpoint/save/pieces.py), so the kills
    # land on incremental saves too.
    done = run(root, BASE_ID, "model.freeze=[model.layers.0.*]", logs=logs, create=True, umask=0)
    if done.proc.returncode != 0:
        raise AssertionError(f"the base run failed:\n{done.output}")


def base_run(dest_root: Path, logs: Path) -> RunLayout:
    """A copy, under ``dest_root``, of a finished tiny run (``base``: steps 4 and 8, consolidated, exported; its
    first layer frozen, so its saves share that layer's piece).

    The run is made once per test session (by one xdist worker, shared with the others: ``tests/reliability/
    conftest.py``), under ``umask 000`` (so the permissions scenario can inspect it as it is), then copied whole
    with its root layout (``<root>/tiny/base``) for every scenario that needs one.
    """
    if "root" not in _base:
        _base["root"] = _make_base(logs)
    src = RunLayout.for_run(_base["root"], "tiny", BASE_ID).run_dir
    dest = RunLayout.for_run(dest_root, "tiny", BASE_ID)
    dest.run_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dest.run_dir, symlinks=True)
    return dest


def base_run_dir() -> Path | None:
    """The original base run (for read-only inspection), once :func:`base_run` has made it."""
    return RunLayout.for_run(_base["root"], "tiny", BASE_ID).run_dir if "root" in _base else None


# --- invariants -------------------------------------------------------------------------------------------


def committed(layout: RunLayout) -> dict[int, str]:
    """Every published step with a manifest: step -> the manifest's hash."""
    out = {}
    if layout.checkpoints.is_dir():
        for d in layout.checkpoints.iterdir():
            step = parse_step(d.name)
            if step is not None and (d / MANIFEST).is_file():
                out[step] = hash_file(d / MANIFEST)
    return dict(sorted(out.items()))


def _check_latest(layout: RunLayout) -> tuple[int | None, list[str]]:
    """The step ``latest`` names (None if none or unreadable) and what is wrong with it."""
    try:
        latest = read_latest(layout)
    except Exception as e:  # noqa: BLE001 - any failure to read latest is a violation to report
        return None, [f"latest unreadable: {type(e).__name__}: {e}"]
    if latest is None:
        return None, []
    try:
        verify_committed(layout.committed_step(latest.step))
    except Exception as e:  # noqa: BLE001
        return latest.step, [f"latest names step {latest.step}, which does not verify: {type(e).__name__}: {e}"]
    return latest.step, []


def _check_steps(layout: RunLayout, *, unfinished_ok: bool) -> tuple[set[int], list[str]]:
    """The published steps and those that do not verify against their manifest (or have none).

    ``unfinished_ok``: a step moved into place whose manifest was not yet written (the commit's last write: a
    fault between the two leaves it) is no committed step to any reader and no violation right after a fault;
    the next committer pass finishes it, so after a rerun it is one."""
    steps, bad = set(), []
    for d in sorted(layout.checkpoints.iterdir()) if layout.checkpoints.is_dir() else []:
        step = parse_step(d.name)
        if step is None:
            continue
        steps.add(step)
        if not (d / MANIFEST).is_file():
            if not unfinished_ok:
                bad.append(f"{d} is a published step without {MANIFEST} (the rerun did not finish its commit)")
            continue
        try:
            verify_committed(d)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{d} does not verify: {type(e).__name__}: {e}")
    return steps, bad


def check_run(
    layout: RunLayout,
    committed_before: dict[int, str] | None = None,
    *,
    final_step: int | None = None,
) -> list[str]:
    """The invariants after any scenario, as a list of violations (empty: all hold).

    * ``checkpoints/latest`` names a step whose files verify against its manifest;
    * every ``checkpoints/step_N`` has a manifest and verifies against it (without ``final_step``, right after a
      fault, one may still lack its manifest: moved into place, its commit not finished, no reader's step);
    * every step in ``committed_before`` (committed before the fault) is still there, unchanged, and verifies,
      and latest did not go back behind them;
    * with ``final_step``: the run is complete, latest is that step and its export exists.
    """
    latest, bad = _check_latest(layout)
    steps, bad_steps = _check_steps(layout, unfinished_ok=final_step is None)
    bad += bad_steps
    for step, manifest_hash in (committed_before or {}).items():
        manifest = layout.committed_step(step) / MANIFEST
        if step not in steps:
            bad.append(f"committed step {step} was lost ({manifest.parent} is gone)")
        elif not manifest.is_file():
            bad.append(f"committed step {step} lost its manifest ({manifest} is missing)")
        elif hash_file(manifest) != manifest_hash:
            bad.append(f"committed step {step} changed: {manifest} differs from before the fault")
    if committed_before and latest is not None and latest < max(committed_before):
        bad.append(f"latest went back to step {latest} from step {max(committed_before)}")
    if final_step is not None:
        if latest != final_step:
            bad.append(f"latest is {latest}, not the final step {final_step}")
        export = layout.run_dir / "export" / f"step_{final_step}" / "provenance.json"
        if not export.is_file():
            bad.append(f"no export of step {final_step} ({export} is missing)")
    return bad


def recorded_steps(layout: RunLayout) -> int:
    """``train.steps`` as ``run.yaml`` records it: the step a plain continuation of the run trains to."""
    return int(read_run_record(layout.run_yaml).config["train"]["steps"])


def launcher_faults(result: Launch, *, one_line_error: bool) -> list[str]:
    """What a launch's console must never show: a raw traceback; with ``one_line_error``, a multi-line error."""
    bad = []
    if TRACEBACK in result.stdout + result.stderr:
        bad.append(f"pid {result.pid} printed a raw traceback")
    if one_line_error:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        if len(lines) != 1:
            bad.append(f"pid {result.pid} exited {result.proc.returncode} with {len(lines)} stderr lines, not one")
    return bad


def litter(run_dir: Path) -> list[Path]:
    """Half-done writes left under the run dir."""
    return sorted({p for pattern in LITTER for p in run_dir.rglob(pattern)})


def job_ids(layout: RunLayout) -> set[tuple[str, str]]:
    """(stage, job id) of every job folder under ``logs/``."""
    out = set()
    if layout.logs.is_dir():
        for stage in layout.logs.iterdir():
            if stage.is_dir() and stage.name != "leases":
                out |= {(stage.name, d.name) for d in stage.iterdir() if d.is_dir() and d.name.isdigit()}
    return out


def lease_jobs(layout: RunLayout) -> list[dict[str, Any]]:
    """The jobs recorded in the current lease (none if there is no lease or it cannot be read)."""
    try:
        return list(read_json(layout.lease).get("jobs", []))
    except (OSError, ValueError):
        return []


# --- processes --------------------------------------------------------------------------------------------


def _references(proc: psutil.Process, needles: Iterable[str]) -> bool:
    try:
        text = " ".join(proc.cmdline())
        with contextlib.suppress(psutil.Error):
            text += " " + proc.cwd()
    except psutil.Error:
        return False
    return any(n in text for n in needles)


def _tree(pid: int) -> set[int]:
    try:
        return {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {pid}


def leftovers(run_dir: Path, *, grace_s: float = 10.0) -> list[str]:
    """Processes of the run still alive after ``grace_s``: anything whose command line or cwd names the run dir,
    and any child of this test process. Described as ``pid cmdline``."""
    needles = [str(run_dir), str(run_dir.resolve())]
    me = os.getpid()
    deadline = time.monotonic() + grace_s
    while True:
        found = {}
        for p in psutil.process_iter():
            if p.pid == me:
                continue
            with contextlib.suppress(psutil.Error):
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if _references(p, needles):
                    found[p.pid] = p
        with contextlib.suppress(psutil.Error):
            services = {s for pid in SERVICE_PIDS for s in _tree(pid)}  # the session's S3 server, not the run's
            for p in psutil.Process(me).children(recursive=True):
                if p.status() != psutil.STATUS_ZOMBIE and p.pid not in services:
                    found[p.pid] = p
        if not found or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    out = []
    for pid, p in sorted(found.items()):
        with contextlib.suppress(psutil.Error):
            out.append(f"{pid} {' '.join(p.cmdline())[:200]}")
    return out


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every process under it (collected first, then killed); the pids killed."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    killed = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
            killed.append(p.pid)
    psutil.wait_procs(procs, timeout=10)
    return killed


def kill_leftovers(run_dir: Path) -> list[int]:
    """SIGKILL every process that references ``run_dir`` (the orphans of a killed launcher)."""
    needles = [str(run_dir)]
    victims = [p for p in psutil.process_iter() if p.pid != os.getpid() and _references(p, needles)]
    killed = []
    for p in victims:
        killed += kill_tree(p.pid)
    return killed


def job_tree(job_id: str) -> list[psutil.Process]:
    """A local job's processes: its setup shell (pid = job id) and everything under it."""
    try:
        root = psutil.Process(int(job_id))
        return [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, ValueError):
        return []


def ranks_of(job_id: str) -> list[psutil.Process]:
    """The task processes of a local job: submitit's (``submitit.core._submit``) or, for a train job, the ones its
    controller forked (named in its job folder's ``<job id>_tasks.json``: :mod:`launchers.local_forks`)."""
    out = []
    for p in job_tree(job_id):
        with contextlib.suppress(psutil.Error):
            cmdline = p.cmdline()
            if "submitit.core._submit" in " ".join(cmdline):
                out.append(p)
            elif cmdline[-2:-1] == ["launchers.local_forks"]:  # the controller: its argv ends with the job folder
                folder = Path(cmdline[-1].replace("%j", job_id))
                forked = set(forked_tasks(folder, job_id).values())
                out += [c for c in p.children() if c.pid in forked]
    return out


def wait_for(what: str, predicate: Callable[[], Any], timeout: float, *, while_alive: Launch | None = None) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); None if ``while_alive`` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if while_alive is not None and not while_alive.running():
            return None
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
