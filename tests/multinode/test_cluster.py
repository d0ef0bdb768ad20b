"""The cluster is what the tests claim it is: separate nodes, one shared filesystem with a client per node."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.multinode.conftest import LOGIN, NODES, PYTHON, ROOT, SCRIPTS, Cluster

pytestmark = pytest.mark.xdist_group("multinode")  # one worker runs them all, in file order


def test_nodes_are_separate_hosts_with_their_own_mounts(cluster: Cluster, shared_dir: Path) -> None:
    seen = {}
    for node in (LOGIN, *NODES):
        script = "hostname; hostname -i; findmnt -n -o FSTYPE /shared; findmnt -n -o SOURCE /local; ls /sys/class/net"
        out = cluster.run(node, "bash", "-c", script).stdout.split("\n", 4)
        out[4] = " ".join(out[4].split())
        seen[node] = out
        assert out[0] == node and out[2] == "fuse.seaweedfs" and out[3] == f"mnlocal-{node}", out
        assert out[4].split() == ["eth0", "lo"], f"{node} sees other interfaces: {out[4]}"
    assert len({v[1] for v in seen.values()}) == 4, f"addresses not distinct: {seen}"
    # node-local storage is local: what node1 writes to /local, node2 does not see
    cluster.run("node1", "bash", "-c", f"echo one > /local/{shared_dir.name}")
    assert cluster.run("node2", "test", "-e", f"/local/{shared_dir.name}", check=False).returncode != 0
    cluster.run("node1", "rm", f"/local/{shared_dir.name}")
    # the shared filesystem is shared: written through node1's client, read through node3's
    cluster.run("node1", "bash", "-c", f"echo hello > {shared_dir}/f && sync")
    assert cluster.run("node3", "cat", f"{shared_dir}/f").stdout == "hello\n"


def test_slurm_runs_one_job_across_nodes_and_accounts_for_it(cluster: Cluster) -> None:
    out = cluster.run(LOGIN, "srun", "-N3", "bash", "-c", "echo $(hostname) $SLURM_JOB_ID", timeout=120).stdout
    rows = sorted(line.split() for line in out.splitlines())
    assert [r[0] for r in rows] == list(NODES) and len({r[1] for r in rows}) == 1, out
    job = rows[0][1]
    assert cluster.job_state(job, "COMPLETED") == ("COMPLETED", "node[1-3]")


REPLACE_AND_READ = """
import json, sys, time
from pathlib import Path
from pipeline.checkpoint.protocol.ownership import FileLease
from pipeline.storage.atomic import read_json, write_json_atomic
from pipeline.storage.integrity import read_record_json
path, role = Path(sys.argv[1]), sys.argv[2]
t0 = time.time()
if role == "write":
    i = 0
    while time.time() - t0 < 6:
        write_json_atomic(path, {"i": i, "pad": "x" * (i % 7 * 30)})  # its length changes with every replace
        i += 1
        time.sleep(0.02)
else:
    reads, torn = 0, []
    while time.time() - t0 < 5:
        reads += 1
        try:
            read_json(path), read_record_json(path, "record"), json.loads(FileLease(path.parent).get(path.name) or b"")
        except Exception as e:
            torn.append(str(e))
    print(json.dumps({"reads": reads, "torn": torn[:3], "n_torn": len(torn)}))
"""


def test_a_record_replaced_on_one_node_reads_whole_on_another(cluster: Cluster, shared_dir: Path) -> None:
    """Through SeaweedFS's FUSE client a replace seen from another node can read torn for ~10 ms (measured: 218
    torn reads in 10 s); the pipeline's readers read again, so none of theirs is torn."""
    path = str(shared_dir / "record.json")
    cluster.python("node1", "-c", REPLACE_AND_READ, path, "write", timeout=60)  # the file exists before the race
    writer = subprocess.Popen(
        ["bash", str(SCRIPTS / "node.sh"), "exec", "node1", PYTHON, "-c", REPLACE_AND_READ, path, "write"], cwd=ROOT
    )
    try:
        out = json.loads(cluster.python("node3", "-c", REPLACE_AND_READ, path, "read", timeout=60).stdout)
    finally:
        writer.wait(timeout=60)
    assert out["reads"] > 100 and out["n_torn"] == 0, out
