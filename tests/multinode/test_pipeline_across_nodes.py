"""The pipeline across nodes, from the login node's CLI: train on two nodes, the committer on a third."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.multinode.conftest import LOGIN, TINY, Cluster, LatestPoller

pytestmark = pytest.mark.xdist_group("multinode")  # one worker runs them all, in file order

STEPS = (4, 8)
READ_FILES = """
import json, sys
from pathlib import Path
run = Path(sys.argv[1]) / "checkpoints"
out = {}
for step in sys.argv[2:]:
    m = json.loads((run / f"step_{step}" / "manifest.json").read_text())
    out[step] = sorted(json.dumps(f, sort_keys=True) for f in m["files"])
print(json.dumps(out))
"""


def _files(cluster: Cluster, node: str, run_dir: Path) -> dict[str, list[str]]:
    """Each committed step's manifest entries (path, size, hash of every file), read on ``node``."""
    out = cluster.python(node, "-c", READ_FILES, str(run_dir), *map(str, STEPS)).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def test_train_on_two_nodes_and_the_committer_on_a_third_match_one_node(
    cluster: Cluster, shared_dir: Path, tmp_path: Path
) -> None:
    root = shared_dir / "runs"
    multi = root / "tiny" / "multi"
    poller = LatestPoller(cluster, multi, shared_dir, tmp_path / "poll.log")
    try:
        cluster.pipeline(*TINY, f"run.root={root}", "run.id=multi", "launcher.stages.train.nodes=2",
                         "+launcher.stages.verify_manifest.extra.nodelist=node3")  # fmt: skip
    finally:
        poller.stop()
    # the same seed on one node: node1 alone, with the local launcher (no queue to wait in)
    cluster.python("node1", "-m", "pipeline", "+experiment=tiny", "run.create=true", f"run.root={root}", "run.id=one",
                   "export=none")  # fmt: skip

    status = cluster.python(LOGIN, "-m", "pipeline.status", str(multi)).stdout
    rows = {
        line.split()[0]: line.split() for line in status.splitlines() if line.startswith("  ") and len(line.split()) > 4
    }
    assert "node[1-2]" in rows["train"], status
    assert "node3" in rows["verify_manifest"], status

    # the same seed on one node commits the same bytes: every file of every committed step hashes the same
    assert _files(cluster, "node2", multi) == _files(cluster, "node2", root / "tiny" / "one")
    seen = poller.seen
    assert seen["violations"] == [] and seen["seen"], seen
    assert cluster.squeue() == ""
    assert subprocess.run(["findmnt", "-n", "/shared"], capture_output=True, check=False).stdout == b""
