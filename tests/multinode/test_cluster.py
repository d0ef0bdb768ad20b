"""The cluster is what the tests claim it is: separate nodes, one shared filesystem with a client per node."""

from __future__ import annotations

from pathlib import Path

from tests.multinode.conftest import LOGIN, NODES, Cluster


def test_nodes_are_separate_hosts_with_their_own_mounts(cluster: Cluster, shared_dir: Path) -> None:
    seen = {}
    for node in (LOGIN, *NODES):
        out = cluster.run(node, "bash", "-c", "hostname; hostname -i; findmnt -n -o FSTYPE /shared; "
                          "findmnt -n -o SOURCE /local; ls /sys/class/net | tr '\\n' ' '").stdout.split("\n")  # fmt: skip
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
