"""Nodes failing under a run, as users meet them, driven from the login node's CLI."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.multinode.conftest import LOGIN, PYTHON, SCRIPTS, TINY, Cluster, LatestPoller

T = TypeVar("T")

pytestmark = pytest.mark.xdist_group("multinode")  # one worker runs them all, in file order


SLOW_STEP_8 = "PIPELINE_FAULTS=shard_save.before_marker@step=8@restart=0@action=sleep@seconds=15"
"""Every rank of the job's first run pauses 15 s before its done-marker of step 8: the window in which the test
kills a node (the run SLURM requeues goes at full speed)."""
MANIFEST_HASH = """
import sys
from pathlib import Path
from pipeline.storage.integrity import hash_file
print(hash_file(Path(sys.argv[1]) / "checkpoints" / f"step_{sys.argv[2]}" / "manifest.json"))
"""


def _wait_for(cluster: Cluster, path: Path, timeout_s: float, launch: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while cluster.run(LOGIN, "test", "-e", str(path), check=False).returncode != 0:
        if launch.poll() is not None:
            out = launch.stdout.read() if launch.stdout else ""
            raise AssertionError(f"the launch ended ({launch.returncode}) before {path} appeared: {out[-3000:]}")
        if time.monotonic() > deadline:
            nodes = cluster.run(LOGIN, "sinfo", "-N", "-h", "-o", "%N %t %E", check=False).stdout
            raise AssertionError(f"{path} did not appear within {timeout_s:g} s; queue:\n{cluster.squeue()}\n{nodes}")
        time.sleep(1)


def test_a_node_killed_mid_train_costs_no_committed_step_and_the_run_resumes(
    cluster: Cluster, shared_dir: Path, tmp_path: Path
) -> None:
    root = shared_dir / "runs"
    run = root / "tiny" / "killed"
    poller = LatestPoller(cluster, run, shared_dir, tmp_path / "poll.log")
    launch = subprocess.Popen(
        ["bash", str(SCRIPTS / "node.sh"), "exec", LOGIN, "env", SLOW_STEP_8, PYTHON, "-m", "pipeline", *TINY,
         f"run.root={root}", "run.id=killed", "train.steps=12", "launcher.stages.train.nodes=2",
         "+launcher.stages.verify_manifest.extra.nodelist=node3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for(cluster, run / "checkpoints" / "step_4" / "manifest.json", 180, launch)
        step4 = cluster.python(LOGIN, "-c", MANIFEST_HASH, str(run), "4").stdout
        # SLURM gives train the two lowest idle nodes (not pinned: its requeue must be free to take node[1,3])
        queue = cluster.squeue()
        if "train-killed RUNNING node[1-2]" not in queue:
            nodes = cluster.run(LOGIN, "sinfo", "-N", "-h", "-o", "%N %t %E", check=False).stdout
            launch.kill()
            out = launch.communicate()[0]
            raise AssertionError(f"train is not running on node[1-2] at step 4:\n{queue}\n{nodes}\n{out[-6000:]}")
        cluster.node("kill9", "node2")  # everything in node2 dies, its mount with it, mid-way through step 8
        out, _ = launch.communicate(timeout=600)
    finally:
        if launch.poll() is None:
            launch.kill()
        poller.stop()
        cluster.node("up", "node2")
    assert launch.returncode == 0, out
    requeue = [line for line in out.splitlines() if "SLURM queued it again" in line]
    assert len(requeue) == 1 and "node node2 failed" in requeue[0] and "latest = step 4" in requeue[0], out
    assert "resumed from step 4" in out and "committed step 12" in out, out
    # the step committed before the kill is untouched, and every step since verifies (status --verify reads all)
    assert cluster.python(LOGIN, "-c", MANIFEST_HASH, str(run), "4").stdout == step4
    status = cluster.python(LOGIN, "-m", "pipeline.status", "--verify", str(run)).stdout
    assert "latest: step 12" in status and "node[1,3]" in status, status
    seen = poller.seen
    assert seen["violations"] == [] and seen["seen"][-1] == 12, seen


GHOST_WINDOWS = ";".join(
    [
        "verify.before_publish@step=8@restart=0@action=sleep@seconds=45",  # the first committer: before step 8's commit
        "verify.before_latest@step=16@action=sleep@seconds=45",  # the one that follows: before latest moves to 16
        "shard_save.before_marker@step=12@action=sleep@seconds=60",  # train slow enough for both windows
        "shard_save.before_marker@step=20@action=sleep@seconds=60",
    ]
)
"""The committer's node is cut at two commit windows: its first run stops just before publishing step 8, and the
committer that follows stops just before moving ``latest`` to step 16; each is cut off there and healed while
the run goes on."""
SNAPSHOT = """
import json, sys
from pathlib import Path
from pipeline.storage.integrity import hash_file
ck = Path(sys.argv[1]) / "checkpoints"
steps = sorted(int(p.name[5:]) for p in ck.glob("step_*") if (p / "manifest.json").exists())
print(json.dumps({"manifests": {s: hash_file(ck / f"step_{s}" / "manifest.json") for s in steps},
                  "latest": json.loads((ck / "latest").read_text())}))
"""


def _ghost_pids(cluster: Cluster, node: str, run: Path) -> list[str]:
    out = subprocess.run(["bash", str(SCRIPTS / "node.sh"), "pids", node], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if "submitit" in line and str(run) in line]


def _committer_node(cluster: Cluster) -> str:
    rows = [line.split() for line in cluster.squeue().splitlines()]
    return next((r[3] for r in rows if len(r) == 4 and r[1] == "verify-manifest-ghosts" and r[2] == "RUNNING"), "")


def _until(what: str, cond: Callable[[], T], launch: subprocess.Popen[str], cluster: Cluster, timeout_s: float) -> T:
    """The first true value of ``cond``, polled each second until the deadline or the launch's end."""
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        if launch.poll() is not None:
            out = launch.stdout.read() if launch.stdout else ""
            raise AssertionError(f"the launch ended ({launch.returncode}) before {what}: {out[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}; queue:\n{cluster.squeue()}")
        time.sleep(1)
    return got


def test_the_committer_cut_off_at_its_commit_windows_and_healed_mid_run_changes_nothing(
    cluster: Cluster, shared_dir: Path, tmp_path: Path
) -> None:
    root = shared_dir / "runs"
    run = root / "tiny" / "ghosts"
    ck = run / "checkpoints"
    poller = LatestPoller(cluster, run, shared_dir, tmp_path / "poll.log")
    launch = subprocess.Popen(
        ["bash", str(SCRIPTS / "node.sh"), "exec", LOGIN, "env", f"PIPELINE_FAULTS={GHOST_WINDOWS}", PYTHON, "-m",
         "pipeline", *TINY, f"run.root={root}", "run.id=ghosts", "train.steps=20"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    seen: dict[str, str] = {}  # every step's manifest hash when first seen: a ghost may not change one
    cuts: list[str] = []
    out = ""
    try:
        windows = ((8, ck / "staging" / "step_8" / "rank_1.done.json"), (16, ck / "step_16" / "manifest.json"))
        for step, window in windows:

            def in_window(w: Path = window) -> bool:
                return _exists(cluster, w)

            _until(f"step {step} in the committer's window", in_window, launch, cluster, 300)
            time.sleep(3)  # the committer reaches its window (a sleep of 45 s) within a moment of the step's arrival
            # The committer may be gone just then: the end of the ghost of an earlier cut reaches SLURM when the
            # ghost's slurmd next gets through, and SLURM ends the job's requeued run with it (seen in CI at step
            # 16's window). The launcher then starts the committer again, and that one waits in the same window.
            node = _until(f"a committer running in step {step}'s window", lambda: _committer_node(cluster),
                          launch, cluster, 180)  # fmt: skip
            fenced = _latest(cluster, ck)[1]
            cluster.node("cut", node)  # past SlurmdTimeout: SLURM requeues the committer elsewhere
            cuts.append(node)

            def moved(s: int = step, e: int = fenced) -> bool:  # by a committer that took over from the cut one
                now = _latest(cluster, ck)
                return now[0] >= s and now[1] > e

            _until(f"a new committer moving latest to step {step}", moved, launch, cluster, 300)
            seen.update({k: v for k, v in _snapshot(cluster, run)["manifests"].items() if k not in seen})
            cluster.node("heal", node)  # the ghost has its network and mount back while the run goes on
            ghosts = _ghost_pids(cluster, node, run)
            print(f"cut {node} at epoch {fenced}, healed at {_latest(cluster, ck)}: ghost pids {ghosts}")
            cluster.node("resume", node)  # as an admin does: SLURM may place the next requeue there
        out, _ = launch.communicate(timeout=600)
    finally:
        if launch.poll() is None:
            launch.kill()
            out = launch.communicate()[0]
        for node in cuts:
            cluster.node("heal", node)
            cluster.node("resume", node)
        polled = poller.stop()
        print(f"{out}\nlatest as polled from the login node (step, epoch): {polled.get('moves')}")
    assert launch.returncode == 0, out
    # Each cut: SLURM requeues the committer; or, when the ghost's end reaches SLURM first, it ends the job and
    # the launcher starts the committer again, saying why.
    requeues = [line for line in out.splitlines() if "SLURM queued it again" in line]
    restarts = [line for line in out.splitlines() if "verify_manifest: starting it again" in line]
    assert len(requeues) >= 1 and all(line.lstrip().startswith("verify_manifest:") for line in requeues), out
    assert all("a ghost" in line or "ended while train runs" in line for line in restarts), out
    # The launch's last committer says "committed step 20", unless a requeued incarnation of a job it had already
    # restarted (its ghost's end read as the job's) committed it first: then its last lines name latest alone.
    assert "latest -> step 20" in out and not any(line.startswith("FAIL ") for line in out.splitlines()), out
    final = _snapshot(cluster, run)
    assert final["latest"]["step"] == 20, final
    changed = {k: (v, final["manifests"][k]) for k, v in seen.items() if final["manifests"].get(k, v) != v}
    assert not changed, f"a ghost changed committed manifests: {changed}"
    status = cluster.python(LOGIN, "-m", "pipeline.status", "--verify", str(run)).stdout
    assert "latest: step 20" in status, status
    assert polled["violations"] == [] and polled["seen"][-1] == 20, polled


def _exists(cluster: Cluster, path: Path) -> bool:
    return cluster.run(LOGIN, "test", "-e", str(path), check=False).returncode == 0


def _latest(cluster: Cluster, ck: Path) -> tuple[int, int]:
    """``latest``'s (step, epoch) as the login node reads it; (-1, 0) when it does not read."""
    got = cluster.run(LOGIN, "cat", str(ck / "latest"), check=False).stdout
    try:
        obj = json.loads(got)
        return int(obj["step"]), int(obj.get("epoch") or 0)
    except (ValueError, KeyError, TypeError):
        return -1, 0


def _snapshot(cluster: Cluster, run: Path) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(cluster.python(LOGIN, "-c", SNAPSHOT, str(run)).stdout)
    return got
