"""The project's multi-node cluster (``scripts/cluster/start.sh``) as a fixture, and how tests act in it.

Three SLURM nodes and a login node, each a network namespace with its own hostname, address, node-local tmpfs
(``/local``) and its own FUSE client of one SeaweedFS filer at ``/shared``. Tests drive it as a user would: the
pipeline's CLI on the login node (``Cluster.pipeline``), faults through ``scripts/cluster/node.sh`` (kill a node,
cut its network, heal it). Every test here is marked ``multinode``.

The first test session (xdist worker) to need the cluster starts it, the last one out stops it, so nothing is
left behind (mounts, namespaces, bridge, daemons). Its scope is this package: its tests run as one xdist group,
so the cluster stops once they are done, and its idle daemons (about a tenth of a core) do not cost the rest of
the suite. Needs root; skipped with a one-line reason where the packages
are missing and were not installed (``missing Debian packages ...``) or the kernel refuses namespaces or FUSE
(``the kernel refuses ...``); ``tests/conftest.py`` fails the session after the first where this machine could
have installed them, and after either under CI.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.session_users import session_users

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPTS = ROOT / "scripts" / "cluster"
MN_ROOT = Path(os.environ.get("MN_ROOT") or "/tmp/pipeline-cluster")
NODES = ("node1", "node2", "node3")
LOGIN = "login"
SHARED = Path("/shared")
TINY = ("+experiment=tiny", "launcher=slurm", "launcher.wait=true", "run.create=true", "export=none")
"""The embedded experiment on the cluster's SLURM, the launcher watching (as a user at the login node); no export
stage: the tests judge the commits, the nodes and the queue, never the outputs."""
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv").exists() else "python3"
SKIP_CODES = {3: "missing Debian packages slurmctld slurmd slurm-client slurmdbd mariadb-server munge fuse3 util-linux "
                 "iproute2 bc curl",
              4: "the kernel refuses network namespaces or FUSE here"}  # fmt: skip
"""start.sh's exit statuses that skip, and the start of the reason (``tests/conftest.py`` sorts skips by it)."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.multinode)
            item.add_marker(pytest.mark.slow)  # minutes of real jobs: not in the quick tier (-m "not slow")


@dataclass(frozen=True)
class Cluster:
    """The running cluster: run commands inside its nodes, break and mend them."""

    root: Path

    def run(self, node: str, *cmd: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``cmd`` inside ``node`` (its network, hostname and mounts), from the project root."""
        proc = subprocess.run(
            ["bash", str(SCRIPTS / "node.sh"), "exec", node, *cmd],
            cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"on {node}: {shlex.join(cmd)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def popen(self, node: str, *cmd: str, log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            return subprocess.Popen(
                ["bash", str(SCRIPTS / "node.sh"), "exec", node, *cmd], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )

    def python(
        self, node: str, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.run(node, PYTHON, *args, timeout=timeout, check=check)

    def pipeline(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``python -m pipeline ARGS`` on the login node, as a user there types it."""
        return self.python(LOGIN, "-m", "pipeline", *args, timeout=timeout, check=check)

    def node(self, action: str, node: str) -> None:
        """``scripts/cluster/node.sh ACTION NODE``: kill, kill9, up, cut, heal."""
        proc = subprocess.run(["bash", str(SCRIPTS / "node.sh"), action, node], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, check=False)  # fmt: skip
        if proc.returncode != 0:
            raise AssertionError(f"node.sh {action} {node} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")

    def scratch(self) -> Path:
        """A fresh directory on the shared filesystem (made from the login node); removed by the test's fixture."""
        path = SHARED / "tests" / uuid.uuid4().hex[:10]
        self.run(LOGIN, "mkdir", "-p", str(path))
        return path

    def job_state(self, job: str, want: str, timeout_s: float = 60) -> tuple[str, str]:
        """``job``'s (state, node list) from accounting once it reads ``want`` (accounting lags the job's end by
        a moment); after ``timeout_s`` whatever it reads last."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.run(LOGIN, "sacct", "-X", "-n", "-P", "-j", job, "-o", "State,NodeList", check=False).stdout
            rows = [line.split("|") for line in out.splitlines() if line.count("|") == 1]
            state, nodes = (rows[-1][0].split()[0], rows[-1][1]) if rows else ("unknown", "")
            if state == want or time.monotonic() >= deadline:
                return state, nodes
            time.sleep(0.5)

    def squeue(self) -> str:
        return self.run(LOGIN, "squeue", "-h", "-o", "%i %j %T %N").stdout


class LatestPoller:
    """``tests/multinode/poll_latest.py`` on the login node, whose client writes nothing of the run: it verifies
    every step ``run``'s ``latest`` names while the test runs; :meth:`stop` ends it and keeps its verdict."""

    def __init__(self, cluster: Cluster, run: Path, scratch: Path, log: Path) -> None:
        self.cluster, self.flag, self.out = cluster, scratch / "stop-poller", scratch / "poll.json"
        self.seen: dict[str, Any] = {}
        self.proc = cluster.popen(LOGIN, PYTHON, "-m", "tests.multinode.poll_latest", str(run), str(self.out),
                                  str(self.flag), log=log)  # fmt: skip

    def stop(self) -> dict[str, Any]:
        """``{"seen": [steps], "violations": [...], "polls": N}`` (empty if the poller wrote none)."""
        if self.proc.poll() is None:
            self.cluster.run(LOGIN, "touch", str(self.flag), check=False)
            self.proc.wait(timeout=60)
        out = self.cluster.run(LOGIN, "cat", str(self.out), check=False).stdout
        self.seen = json.loads(out) if out else {}
        return self.seen


def _script(name: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MN_ROOT": str(MN_ROOT)}
    return subprocess.run(["bash", str(SCRIPTS / name)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, check=False)  # fmt: skip


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip(f"needs root: bash {SCRIPTS.relative_to(ROOT)}/start.sh makes namespaces and FUSE mounts")
    with session_users(MN_ROOT) as users:
        if not users["pids"]:
            started = time.monotonic()
            result = _script("start.sh", 600)
            if result.returncode in SKIP_CODES:
                last = (result.stdout.strip().splitlines() or ["no output"])[-1]
                why = re.sub(r"^\[[\w/.-]+\]\s+(\d\d:\d\d:\d\d\s+)?(ERROR:\s+)?", "", last)
                pytest.skip(f"{SKIP_CODES[result.returncode]}: {why}")
            if result.returncode != 0:  # nothing half-up is left: stop what the start brought up
                _script("stop.sh", 180)
                tail = "\n".join(result.stdout.splitlines()[-20:])
                pytest.fail(f"scripts/cluster/start.sh failed ({result.returncode}):\n{tail}", pytrace=False)
            print(f"\ncluster: started in {time.monotonic() - started:.1f}s")
        users["pids"].append(os.getpid())
    try:
        yield Cluster(MN_ROOT)
    finally:
        with session_users(MN_ROOT) as users:
            users["pids"] = [p for p in users["pids"] if p != os.getpid()]
            if not users["pids"]:
                stopped = _script("stop.sh", 180)
                assert stopped.returncode == 0, stopped.stdout


@pytest.fixture(autouse=True)
def _one_multinode_test_at_a_time() -> Iterator[None]:
    """Each test assumes the cluster's nodes are its alone."""
    with open(Path(os.environ.get("TMPDIR", "/tmp")) / "pipeline-multinode-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture
def shared_dir(cluster: Cluster) -> Iterator[Path]:
    """A fresh directory on the shared filesystem; checked empty of jobs and removed after the test."""
    path = cluster.scratch()
    yield path
    cluster.run(LOGIN, "bash", "-c", "scancel --full $(squeue -h -o %i) 2>/dev/null; true", check=False)
    cluster.run(LOGIN, "rm", "-rf", str(path), check=False)
