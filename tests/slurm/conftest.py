"""The project's single-node SLURM cluster for tests (``scripts/slurm/start.sh``), as a package fixture.

A cluster that is already up and usable (``scontrol ping`` says UP, the node is idle/mix/alloc) is used as it
is and never stopped: starting the script with another ``SLURM_ROOT`` would generate another config and so
restart, or refuse to touch, a cluster other people may be using. Otherwise the fixture starts one with
``SLURM_ROOT=/tmp/pipeline-slurm`` (or ``$SLURM_ROOT``) and stops it once this package's tests are done (they
run as one xdist group): its idle daemons do not cost the rest of the suite.

Needs root. Skipped when not root (``needs root: ...``) or when the packages are missing and were not installed
(``missing Debian packages ...: `` and why, from ``scripts/system-packages.sh``); ``tests/conftest.py`` fails the
session after such a skip where this machine could have installed them, or under CI. Any other failure to
start is an error. Every test under ``tests/slurm`` is marked ``slurm``.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from pipeline.stagekit.jobs import ACTIVE_STATES, slurm_states
from tests.session_users import session_users

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
START_SCRIPT = ROOT / "scripts" / "slurm" / "start.sh"
STOP_SCRIPT = ROOT / "scripts" / "slurm" / "stop.sh"
DEFAULT_SLURM_ROOT = Path("/tmp/pipeline-slurm")
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 120
INSTALL_FAILED = 3
"""start.sh's exit status when packages are missing and were not installed (its last line says why)."""
PACKAGES = "slurmctld slurmd slurm-client munge procps slurmdbd mariadb-server"
"""The Debian packages start.sh installs (with accounting, as the fixture starts it)."""
USABLE_NODE_STATES = frozenset({"idle", "mix", "alloc"})
OUTPUT_TAIL_LINES = 15


@dataclass(frozen=True)
class SlurmCluster:
    partition: str
    """Partition to submit to (the default one)."""
    root: Path
    """The cluster's SLURM_ROOT (state, logs, spool, pid files)."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.slurm)
            # a grouping hint for pytest-xdist; measured here, the group does not reach the workers' node ids, so
            # the tests may spread over workers: the cluster fixture is shared between them (see tests/session_users.py)
            item.add_marker(pytest.mark.xdist_group("slurm"))


def _output(cmd: list[str]) -> str | None:
    """stdout of ``cmd``, or None when it is missing, fails or hangs."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def running_cluster() -> SlurmCluster | None:
    """The cluster that answers on this machine, if its controller is up and its node can run jobs."""
    if "is UP" not in (_output(["scontrol", "ping"]) or ""):
        return None
    node_states = (_output(["sinfo", "-h", "-o", "%t"]) or "").split()
    if not USABLE_NODE_STATES.intersection(node_states):
        return None
    partitions = (_output(["sinfo", "-h", "-o", "%P"]) or "").split()
    if not partitions:
        return None
    partition = next((p for p in partitions if p.endswith("*")), partitions[0]).rstrip("*")
    state_dir = ""
    for line in (_output(["scontrol", "show", "config"]) or "").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "StateSaveLocation":
            state_dir = value.strip()
    return SlurmCluster(partition=partition, root=Path(state_dir).parent if state_dir else Path("?"))


def _cannot_start(reason: str, output: str, *, skip: bool) -> NoReturn:
    """Skip (the packages are missing: ``reason`` names them first, for ``tests/conftest.py``) or fail, with the
    script's last lines; the first line of the reason ends with the script's own last line, why."""
    lines = output.rstrip().splitlines()
    why = re.sub(r"^\[[\w/.-]+\]\s+(\d\d:\d\d:\d\d\s+)?(ERROR:\s+)?", "", lines[-1]) if lines else "no output"
    tail = "\n".join(lines[-OUTPUT_TAIL_LINES:])
    message = f"{reason}: {why}\n--- last lines of {START_SCRIPT.relative_to(ROOT)} ---\n{tail}"
    if skip:
        pytest.skip(message)
    pytest.fail(message, pytrace=False)


def _run_script(script: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.fixture(scope="package")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        pytest.skip(f"needs root: run `sudo bash {START_SCRIPT.relative_to(ROOT)}`, then the tests as root")
    slurm_root = Path(os.environ.get("SLURM_ROOT") or DEFAULT_SLURM_ROOT)
    env = {**os.environ, "SLURM_ROOT": str(slurm_root)}
    with session_users(slurm_root) as users:
        if not users["pids"]:
            users["started"] = False
        cluster = running_cluster()
        if cluster is None:
            cluster = _start(slurm_root, env)
            users["started"] = True
        users["pids"].append(os.getpid())
    try:
        yield cluster
    finally:
        with session_users(slurm_root) as users:
            users["pids"] = [p for p in users["pids"] if p != os.getpid()]
            if not users["pids"] and users["started"]:
                users["started"] = False
                stopped = _run_script(STOP_SCRIPT, env, STOP_TIMEOUT_S)
                if stopped.returncode != 0:
                    warnings.warn(f"stop.sh failed (exit status {stopped.returncode}):\n{stopped.stdout}", stacklevel=1)


def _start(slurm_root: Path, env: dict[str, str]) -> SlurmCluster:
    started = time.monotonic()
    for attempt in (1, 2):  # a daemon slow to come up on a loaded machine: start.sh restarts a half-up cluster
        try:
            result = _run_script(START_SCRIPT, env, START_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            partial = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
            _cannot_start(f"start.sh did not finish within {START_TIMEOUT_S} s", partial, skip=False)
        if result.returncode in (0, INSTALL_FAILED) or attempt == 2:
            break
        time.sleep(5)
    if result.returncode == INSTALL_FAILED:
        _cannot_start(f"missing Debian packages {PACKAGES}", result.stdout, skip=True)
    if result.returncode != 0:
        # no stop.sh after a failed start: start.sh may have refused a cluster of another SLURM_ROOT, whose
        # jobs and shared daemons (munged, mariadbd) stop.sh would take down; start.sh cleans up half-up ones
        _cannot_start(f"start.sh failed (exit status {result.returncode})", result.stdout, skip=False)
    cluster = running_cluster()
    if cluster is None:
        _cannot_start("start.sh succeeded but the cluster does not answer", result.stdout, skip=False)
    print(f"\nslurm: started in {time.monotonic() - started:.1f}s (SLURM_ROOT={slurm_root})")
    return cluster


def wait_for_jobs(job_ids: Iterable[str], timeout_s: float) -> None:
    """Wait until none of ``job_ids`` is queued or running; AssertionError naming those still there after
    ``timeout_s``."""
    ids = sorted({str(j) for j in job_ids})
    if not ids:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(
            ["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        if out.returncode == 0:
            still = {i: s for i, s in (line.split() for line in out.stdout.splitlines()) if s in ACTIVE_STATES}
        elif "Invalid job id" in out.stderr:  # every one of them finished long ago
            still = {}
        else:
            still = dict.fromkeys(ids, f"unknown (squeue: {out.stderr.strip()})")
        if not still:  # accounting can lag squeue by a moment: wait until sacct has every job's end state too
            states = slurm_states(ids)
            still = {i: states.get(i, "unknown to sacct") for i in ids if states.get(i, "PENDING") in ACTIVE_STATES}
        if not still:
            return
        if time.monotonic() >= deadline:
            listed = ", ".join(f"{i} {s}" for i, s in sorted(still.items()))
            raise AssertionError(f"SLURM jobs still queued or running after {timeout_s:g} s: {listed}")
        time.sleep(0.2)


def sacct_states(job_ids: Iterable[str]) -> dict[str, str]:
    """Each job's SLURM state (``COMPLETED``, ``FAILED``, ``CANCELLED``, ...) as read once now; jobs SLURM does
    not know are missing. A job that just ended may show a state that accounting corrects later: assert on
    :func:`settled_states`, not on this."""
    return slurm_states(job_ids)


SETTLE_TIMEOUT_S = 120.0
"""How long :func:`settled_states` waits for accounting to settle (slurmdbd writes a job's end late under load:
seen minutes)."""
SETTLE_STABLE_S = 2.0
"""How long every state must read the same before it counts as settled."""
SETTLE_POLL_S = 0.5
Expected = str | Collection[str]
"""One state, or the states any of which is the right answer (``("COMPLETED", "FAILED")``)."""


def settled_states(
    job_ids: Iterable[str],
    expect: Expected | Mapping[str, Expected] | None = None,
    *,
    timeout_s: float = SETTLE_TIMEOUT_S,
    stable_s: float = SETTLE_STABLE_S,
    read: Callable[[list[str]], dict[str, str]] = slurm_states,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """Each job's end state once accounting has settled: every job has a finished state (known, not queued or
    running), the same on every read for ``stable_s``, and, for the jobs in ``expect`` (one expectation for all,
    or one per job id), the state the job's own outcome implies (a job whose result the test holds
    COMPLETED; a job it cancelled CANCELLED). ``sacct`` can report a job that returned its result as ``FAILED``
    for minutes before it reports ``COMPLETED``: a test reads once more instead of taking the first answer. After
    ``timeout_s`` an AssertionError names every job's last state, what was expected, and each state seen."""
    ids = sorted({str(j) for j in job_ids})
    wanted: dict[str, frozenset[str]] = {}
    for job in ids:
        want = expect.get(job) if isinstance(expect, Mapping) else expect
        if want is not None:
            wanted[job] = frozenset({want} if isinstance(want, str) else want)
    seen: dict[str, list[str]] = {job: [] for job in ids}
    deadline = clock() + timeout_s
    states: dict[str, str] = {}
    since = clock()
    while True:
        now_states = read(ids)
        now = clock()
        if now_states != states:
            states, since = now_states, now
        for job in ids:
            state = states.get(job, "unknown")
            if not seen[job] or seen[job][-1] != state:
                seen[job].append(state)
        ended = all(states.get(j, "PENDING") not in ACTIVE_STATES for j in ids)
        right = all(states.get(j) in want for j, want in wanted.items())
        if ended and right and now - since >= stable_s:
            return states
        if now >= deadline:
            lines = []
            for job in ids:
                want = f", expected {' or '.join(sorted(wanted[job]))}" if job in wanted else ""
                lines.append(f"job {job}: {states.get(job, 'unknown')}{want} (seen: {' -> '.join(seen[job])})")
            raise AssertionError(
                f"SLURM accounting did not settle within {timeout_s:g} s on the states the jobs' own outcomes imply: "
                + "; ".join(lines)
            )
        sleep(SETTLE_POLL_S)


@pytest.fixture(autouse=True)
def _one_slurm_test_at_a_time() -> Iterator[None]:
    """The SLURM tests assume the cluster is theirs alone (``squeue`` empty, the node's CPUs free), and pytest-xdist
    may run them on several workers: one at a time, by an exclusive lock across the workers."""
    with open(Path(os.environ.get("TMPDIR", "/tmp")) / "pipeline-slurm-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
