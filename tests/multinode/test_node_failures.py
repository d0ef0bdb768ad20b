"""Nodes failing under a run, as users meet them, driven from the login node's CLI."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.multinode.conftest import LOGIN, PYTHON, SCRIPTS, TINY, Cluster, LatestPoller

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


SLOW_STEP_8_20S = "PIPELINE_FAULTS=shard_save.before_marker@step=8@action=sleep@seconds=20"
"""Step 8 is staged only after the cut: the committer that commits it is the one that took over."""
SNAPSHOT = """
import json, sys
from pathlib import Path
from pipeline.storage.integrity import hash_file
ck = Path(sys.argv[1]) / "checkpoints"
steps = sorted(int(p.name[5:]) for p in ck.glob("step_*"))
print(json.dumps({"manifests": {s: hash_file(ck / f"step_{s}" / "manifest.json") for s in steps},
                  "latest": json.loads((ck / "latest").read_text())}))
"""
GHOST_S = 10
"""How long the cut-off committer runs on after its node's network is back, before SLURM hears of it."""


def _ghost_pids(cluster: Cluster, node: str, run: Path) -> list[str]:
    out = subprocess.run(["bash", str(SCRIPTS / "node.sh"), "pids", node], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if "submitit" in line and str(run) in line]


def test_the_committers_node_cut_off_is_replaced_and_its_ghost_changes_nothing(
    cluster: Cluster, shared_dir: Path, tmp_path: Path
) -> None:
    root = shared_dir / "runs"
    run = root / "tiny" / "cut"
    poller = LatestPoller(cluster, run, shared_dir, tmp_path / "poll.log")
    # train fills node1 and node2 (2 CPUs each): the committer gets node3
    launch = subprocess.Popen(
        ["bash", str(SCRIPTS / "node.sh"), "exec", LOGIN, "env", SLOW_STEP_8_20S, PYTHON, "-m", "pipeline", *TINY,
         f"run.root={root}", "run.id=cut", "train.steps=16", "launcher.stages.train.nodes=2",
         "launcher.stages.train.cpus_per_task=2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    healed = False
    try:
        _wait_for(cluster, run / "checkpoints" / "step_4" / "manifest.json", 180, launch)
        assert "verify-manifest-cut RUNNING node3" in cluster.squeue(), cluster.squeue()
        cluster.node("cut", "node3")  # past SlurmdTimeout: SLURM requeues the committer; the old one runs on, cut off
        out, _ = launch.communicate(timeout=600)
        assert launch.returncode == 0, out
        before = json.loads(cluster.python(LOGIN, "-c", SNAPSHOT, str(run)).stdout)
        cluster.node("heal", "node3")
        healed = True
        # The ghost has its network and its mount back while SLURM still has node3 down. (A cut that lasts long,
        # on a loaded machine, can end it before the heal: its FUSE client fails the blocked calls with EIO.)
        ghost = _ghost_pids(cluster, "node3", run)
        print(f"ghost committer at the heal: {ghost or 'none (it ended while cut off)'}\n{out}")
        time.sleep(GHOST_S)
        after = json.loads(cluster.python(LOGIN, "-c", SNAPSHOT, str(run)).stdout)
    finally:
        if launch.poll() is None:
            launch.kill()
        if not healed:
            cluster.node("heal", "node3")
        cluster.node("resume", "node3")
        poller.stop()
    lines = [line for line in out.splitlines() if "SLURM queued it again" in line]
    assert len(lines) == 1 and lines[0].lstrip().startswith("verify_manifest:") and "node node3 failed" in lines[0]
    assert "committed step 16" in out, out
    assert before["latest"]["step"] == 16 and before["latest"]["epoch"] == 2, before  # the new committer's
    assert after == before, f"the ghost changed the checkpoints: {before} -> {after}"
    deadline = time.monotonic() + 60  # once SLURM hears from node3 again, it ends the ghost's step
    while _ghost_pids(cluster, "node3", run) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _ghost_pids(cluster, "node3", run), "the ghost outlived node3's return"
    assert cluster.squeue() == ""
    status = cluster.python(LOGIN, "-m", "pipeline.status", "--verify", str(run)).stdout
    assert "latest: step 16" in status, status
    seen = poller.seen
    assert seen["violations"] == [] and seen["seen"][-1] == 16, seen
